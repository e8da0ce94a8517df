"""``--preload auto``: what a rank's next standby imports, learned from its last worker.

The rule (docs/design.md, "standby"):

- A warm worker (one that runs in a standby) records the modules it has imported, 1, 5,
  20 and 60 s after it started, in ``attempt_K/LOCAL_RANK/imported_modules.txt`` (one
  name per line, in import order), leaving out every module whose file lies under the
  script's directory or the working directory. A worker killed by SIGKILL has written its
  last record by then; nothing is recorded at exit.
- A cold worker records nothing; for it the supervisor reads ``/proc/PID/maps`` once the
  rank has progressed and takes the top-level packages of the shared objects it mapped
  from a ``site-packages``/``dist-packages`` directory (``torch`` for a torch job).
- The next standby of that rank imports those of the names whose top-level package
  belongs to an installed distribution (``importlib.metadata``), at idle priority, while
  every read of a per-attempt variable (``RANK``, ``MASTER_PORT``...) through
  ``os.environ`` is watched: a module that reads one while it imports taints the standby,
  which is discarded; its top-level package is never preloaded again in this run, and a
  new standby starts without it. Reads from C (``getenv``) are not seen.

This module holds the supervisor's side: reading what workers left (untrusted input:
bounded, validated, never followed through a symlink) and writing a standby's list.
"""

from __future__ import annotations

import contextlib
import marshal
import os
import stat
import tempfile
from pathlib import Path

from supervisor.core.envs import PER_ATTEMPT_ENV

RECORD_NAME = "imported_modules.txt"
MAX_RECORD = 4 << 20  # bytes of a worker's record we read at most
MAX_NAMES = 20_000
_SITE_DIRS = ("site-packages", "dist-packages")


def is_module_name(name: str) -> bool:
    return bool(name) and len(name) < 256 and all(p.isidentifier() for p in name.split("."))


def read_record(rank_dir: Path) -> list[str]:
    """The module names a warm worker recorded (empty if none or unreadable)."""
    try:
        fd = os.open(rank_dir / RECORD_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_CLOEXEC)
    except OSError:
        return []
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return []
        data = f.read(MAX_RECORD + 1)
    if len(data) > MAX_RECORD:
        return []
    names = [n for n in data.decode("utf-8", "replace").splitlines() if is_module_name(n)]
    return names[:MAX_NAMES]


def mapped_packages(pid: int) -> list[str]:
    """Top-level packages of the shared objects ``pid`` mapped from site-packages."""
    found: dict[str, None] = {}
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.rstrip("\n").partition("/")[2]
                if not path.endswith(".so") and ".so." not in path:
                    continue
                parts = ("/" + path).split("/")
                for i, part in enumerate(parts[:-2]):
                    if part in _SITE_DIRS:
                        top = parts[i + 1]
                        if is_module_name(top) and not top.endswith(".libs"):
                            found[top] = None
                        break
    except OSError:
        return []
    return list(found)


def write_spec(names: list[str], exclude: set[str]) -> str:
    """A private file with the standby's auto list (it reads and removes it)."""
    fd, path = tempfile.mkstemp(prefix="elastic-supervisor-preload-")
    with os.fdopen(fd, "wb") as f:
        f.write(marshal.dumps({
            "names": names, "exclude": sorted(exclude), "watch": list(PER_ATTEMPT_ENV),
        }))
    return path


def remove_spec(path: str | None) -> None:
    if path:
        with contextlib.suppress(OSError):
            os.unlink(path)
