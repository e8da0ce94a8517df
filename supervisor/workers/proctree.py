"""Finding and signalling a process's descendants without scanning all of /proc.

``/proc/PID/task/TID/children`` lists a task's children directly, so walking a worker's
tree costs a few small reads instead of psutil's scan of every process on the host (about
4 ms each on a busy 2-core machine, five times per restart). Signals go through pidfds:
a pid read from /proc is pinned with ``pidfd_open`` and checked to still have the parent
we found it under, so a recycled pid is never signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (all its threads' children); [] if it is gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found: list[int] = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found.extend(int(p) for p in f.read().split())
        except (OSError, ValueError):
            continue
    return found


def descendants(roots: Iterable[int]) -> list[tuple[int, int]]:
    """Every descendant of ``roots`` as (pid, parent pid), parents before children."""
    result: list[tuple[int, int]] = []
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        parent = stack.pop()
        for child in children(parent):
            if child not in seen:
                seen.add(child)
                result.append((child, parent))
                stack.append(child)
    return result


def parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def signal_tree(tree: Iterable[tuple[int, int]], signum: int) -> int:
    """Signal each (pid, parent) that still has that parent; returns how many were hit."""
    hit = 0
    for pid, parent in tree:
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            # the pidfd pins the process: if it still has the parent we found it under,
            # it is the same process, not a newcomer that reused the pid
            if parent_of(pid) == parent:
                signal.pidfd_send_signal(fd, signum)
                hit += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return hit


def reap_children(pids: Iterable[int]) -> None:
    """Collect zombies among ``pids`` (our own children), without blocking."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)
