"""Whether a pid names a live process (a leaf module: imports nothing of ours)."""

from __future__ import annotations

import os


def pid_exists(pid: int) -> bool:
    """True if ``pid`` is a live process, ours or another user's (signal 0 delivers
    nothing; EPERM still means someone holds the pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
