"""Running a process as another user (``setpriv``), for the tests that drop root."""

from __future__ import annotations

import shutil
import subprocess
import sys


def as_user(user: str) -> list[str]:
    """The command prefix that runs what follows as ``user`` (name or uid), no groups."""
    return [shutil.which("setpriv") or "setpriv", f"--reuid={user}", f"--regid={user}",
            "--clear-groups", "--"]


def python_for(user: str) -> str | None:
    """An interpreter of this Python version that ``user`` may run (a venv under /root's
    pyenv is not one), with our site-packages on its path through PYTHONPATH."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for python in (sys.executable, shutil.which(version) or "", f"/usr/bin/{version}"):
        # run by one of its own children: setpriv itself may still cross /root
        again = "import os, sys; os.execv(sys.executable, [sys.executable, '-c', ''])"
        if python and subprocess.run([*as_user(user), python, "-c", again], timeout=30,
                                     capture_output=True).returncode == 0:
            return python
    return None
