"""Running a process as another user (``setpriv``), for the tests that drop root."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path


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


def unreachable(user: int, paths: Iterable[str | Path]) -> Path | None:
    """The first of ``paths`` that ``user`` (uid, in its own group and no other) may not
    read (a directory: list and enter), or None. Asked of the kernel: ``test -r`` (and
    ``-x``) runs as that user, so every directory on the way is checked as an open of the
    path would be (a clone below a 0700 home is closed to everyone else)."""
    test = shutil.which("test") or "/usr/bin/test"
    for path in map(Path, paths):
        checks = ["-r", str(path), "-a", "-x", str(path)] if path.is_dir() else ["-r", str(path)]
        done = subprocess.run([test, *checks], user=user, group=user, extra_groups=[],
                              timeout=30, check=False)
        if done.returncode != 0:
            return path
    return None


def closed_to(user: int, paths: Iterable[str | Path]) -> str | None:
    """A one-line skip reason when ``user`` cannot reach one of ``paths``, else None."""
    path = unreachable(user, paths)
    if path is None:
        return None
    return (f"user {user} cannot read {path} (it or a directory above it is closed to "
            "others, as a 0700 home is): clone the repository where others may enter")
