"""Which worker a deadline request's pid belongs to, looked up once per process.

A request is accepted from a live worker of the current attempt or one of its
descendants. Finding that out walks parent pids in ``/proc`` (a read per level), which a
worker flooding the FIFO could make the supervisor do for every line (issue 52: 60 levels
deep, the loop stalled 21 s). ``OwnerCache`` does it once per process: the answer, owned
or not, is kept with a pidfd of that process, and dropped when the process exits (its pid
may then name another process), when the set of live workers changes, or when the cache
is full. A later line from the same process costs a dict look-up.

The process is judged by its ancestry when it is first seen: a descendant reparented to
init afterwards (its parent died) keeps its answer while it lives.
"""

from __future__ import annotations

import os
import select
from collections.abc import Callable, Mapping

MAX_DEPTH = 16
"""Parent links walked from a request's pid to its worker. Real trees are shallow: a
worker's DataLoader workers are 1 level down, a compile pool's workers 2, a shell or
launcher wrapper adds 1-2. A process deeper than this is not owned (its request is
dropped as ``not_owned``)."""
MAX_ENTRIES = 256  # processes remembered at once (each holds a pidfd); then the oldest go

Workers = Callable[[], Mapping[int, int]]
"""{pid: local rank} of the live workers of the current attempt."""


def owner_by_ancestry(pid: int, workers: Mapping[int, int], max_depth: int = MAX_DEPTH
                      ) -> int | None:
    """The local rank of the worker that is ``pid`` or one of its ancestors, else None.

    Walks at most ``max_depth`` parent links in ``/proc``; never past pid 1 or the
    supervisor itself.
    """
    me = os.getpid()
    current: int | None = pid
    for _ in range(max_depth + 1):
        if current is None or current <= 1 or current == me:
            return None
        if current in workers:
            return workers[current]
        current = _parent_pid(current)
    return None


def _parent_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name may hold spaces and parentheses: fields resume after the last ')'
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 else None


class OwnerCache:
    """``owner(pid)``: the local rank owning ``pid`` (``owner_by_ancestry``), remembered
    per process while it lives. Call ``close`` when done (it holds pidfds)."""

    def __init__(self, workers: Workers, max_depth: int = MAX_DEPTH,
                 max_entries: int = MAX_ENTRIES) -> None:
        self._workers = workers
        self._max_depth = max_depth
        self._max_entries = max_entries
        self._known: dict[int, tuple[int, int | None]] = {}  # pid -> (pidfd, rank or None)
        self._pids: dict[int, int] = {}  # pidfd -> pid
        self._for: dict[int, int] = {}  # the workers the answers were found against
        self._exits = select.epoll()  # the pidfds: readable once their process exits

    def __call__(self, pid: int) -> int | None:
        workers = self._workers()
        if workers != self._for:  # a worker exited or a new attempt began
            self.clear()
            self._for = dict(workers)
        self._drop_exited()
        known = self._known.get(pid)
        if known is not None:
            return known[1]
        return self._learn(pid, workers)

    @property
    def size(self) -> int:
        """Processes remembered now."""
        return len(self._known)

    def clear(self) -> None:
        """Forget every answer (and close their pidfds)."""
        for pid in list(self._known):
            self._forget(pid)

    def close(self) -> None:
        self.clear()
        self._exits.close()

    def _learn(self, pid: int, workers: Mapping[int, int]) -> int | None:
        try:
            pidfd = os.pidfd_open(pid)  # pinned first: the walk is then of this process
        except OSError:
            return None  # gone (or never was): nothing to remember
        rank = owner_by_ancestry(pid, workers, self._max_depth)
        if select.select([pidfd], [], [], 0)[0]:  # it exited meanwhile: the walk may be
            os.close(pidfd)                       # of another process with its pid
            return None
        if len(self._known) >= self._max_entries:
            self._forget(next(iter(self._known)))
        self._known[pid] = (pidfd, rank)
        self._pids[pidfd] = pid
        self._exits.register(pidfd, select.EPOLLIN)
        return rank

    def _drop_exited(self) -> None:
        if not self._known:
            return
        for pidfd, _ in self._exits.poll(0):
            self._forget(self._pids[pidfd])

    def _forget(self, pid: int) -> None:
        pidfd, _ = self._known.pop(pid)
        del self._pids[pidfd]
        self._exits.unregister(pidfd)
        os.close(pidfd)
