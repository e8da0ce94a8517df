"""Whether an interpreter other than the supervisor's can run the standby and fork server
programs (``$PYTHON_EXEC``, or a job's own venv named by ``--no-python``).

Both programs are run from their files' text (``python -u -c TEXT``) and import only the
standard library, so the job's interpreter needs nothing of ours, and a ``supervisor``
package of another version in its venv is never imported. What they need of it:
CPython 3.10 or later on Linux (``sys.orig_argv``, ``zip(strict=)``, PEP 604 annotations
evaluated at run time, ``importlib.metadata.packages_distributions``).
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping

OLDEST = (3, 10)
PROBE = "import sys; print(sys.implementation.name, *sys.version_info[:2])"
PROBE_TIMEOUT = 30.0  # s: an interpreter's start on a loaded node


def unsupported(python: str, env: Mapping[str, str]) -> str | None:
    """Why ``python`` cannot run our standbys (one line), or None if it can. Runs it once,
    in the worker's environment (blocking: at the supervisor's start)."""
    try:
        done = subprocess.run([python, "-I", "-c", PROBE], env=dict(env), capture_output=True,
                              text=True, timeout=PROBE_TIMEOUT, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot run {python}: {exc}"
    fields = done.stdout.split()
    if done.returncode != 0 or len(fields) != 3 or not all(f.isdigit() for f in fields[1:]):
        return f"{python} did not answer as a Python interpreter (exit code {done.returncode})"
    name, version = fields[0], (int(fields[1]), int(fields[2]))
    if name != "cpython" or version < OLDEST:
        return (f"{python} is {name} {version[0]}.{version[1]}; standbys need CPython "
                f"{OLDEST[0]}.{OLDEST[1]} or later")
    return None
