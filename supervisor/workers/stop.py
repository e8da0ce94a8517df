"""Stopping a worker group: signal -> grace -> SIGKILL -> sweep descendants -> reap.

One shielded function does the whole escalation, so a cancelled caller never leaves a
half-stopped group behind. Signals go out first; the tree is looked up after, from
``/proc/PID/task/*/children`` (no scan of every process). Workers stay unreaped (zombies)
until the sweep is done, so their process group ids cannot be recycled while we signal
them, and every other process is signalled through a pidfd taken when it was found.

A worker that survives SIGKILL longer than the stop waits (uninterruptible sleep, e.g. a
GPU driver's teardown) is kept here, unreaped, and reaped by a later stop once it is dead
(even when a sweep finds it first as an adopted child): through its ``Worker``, so the
guardian forgets its group first (``spawn.on_reaping``) and its pidfd is closed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Iterable, Sequence

import anyio

from supervisor.workers.proctree import children, descendants, parent_of, reap_children
from supervisor.workers.spawn import Worker, notify_reaping

logger = logging.getLogger(__name__)

KILL_WAIT = 5.0  # seconds to wait for SIGKILLed workers before giving up on them

_lingering: dict[int, Worker] = {}  # pid -> a worker that survived SIGKILL, still unreaped


def lingering() -> list[int]:
    """Pids of workers that survived their stop's SIGKILL and are not reaped yet."""
    return list(_lingering)


class ProcessTree:
    """Descendants found so far, each pinned by a pidfd (so a recycled pid is never hit)."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}
        self._parents: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._fds)

    def add(self, pid: int, parent: int) -> None:
        if pid in self._fds:
            return
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return
        if parent_of(pid) != parent:  # gone and recycled between the read and the open
            os.close(fd)
            return
        self._fds[pid] = fd
        self._parents[pid] = parent

    def add_descendants(self, roots: Iterable[int]) -> None:
        for pid, parent in descendants(roots):
            self.add(pid, parent)

    def add_adopted(self, keep: set[int]) -> None:
        """Processes reparented to us (a child subreaper) that are not ours to keep."""
        me = os.getpid()
        adopted = [pid for pid in children(me) if pid not in keep]
        for pid in adopted:
            self.add(pid, me)
        self.add_descendants(adopted)

    def signal(self, signum: int) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(fd, signum)

    async def wait_dead(self, timeout: float) -> None:
        """Wait (bounded) until every process in the tree has exited."""
        with anyio.move_on_after(timeout):
            for fd in self._fds.values():
                await anyio.wait_readable(fd)  # a pidfd is readable once the process exits

    def reap_ours(self) -> None:
        """Collect the zombies of those that were reparented to us (not the lingering
        workers among them: their ``Worker`` reaps them)."""
        me = os.getpid()
        dead = [pid for pid in self._fds
                if pid not in _lingering and parent_of(pid) == me and _is_dead(pid)]
        for pid in dead:
            notify_reaping(pid)
        reap_children(dead)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


async def stop_group(
    workers: Sequence[Worker],
    *,
    signum: int,
    grace: float,
    kill_now: anyio.Event,
    sweep_adopted: bool,
    exempt: Iterable[int] = (),
    kill_wait: float = KILL_WAIT,
) -> None:
    """Stop every worker and every descendant; return once all are reaped (or, for one
    that survives SIGKILL for ``kill_wait`` seconds, kept for a later stop to reap)."""
    keep = {w.pid for w in workers} | set(exempt)
    tree = ProcessTree()
    with anyio.CancelScope(shield=True):
        try:
            for worker in workers:
                worker.signal_group(signum)
            _collect(tree, workers, keep, sweep_adopted)
            tree.signal(signum)
            await _wait_all_or(workers, grace, kill_now)
            for worker in workers:
                worker.signal_group(signal.SIGKILL)
            _collect(tree, workers, keep, sweep_adopted)  # anything started during the grace
            tree.signal(signal.SIGKILL)
            await _wait_all_or(workers, kill_wait, None)
            await tree.wait_dead(kill_wait)
            _reap(workers, kill_wait)
            _reap_lingering()
            tree.reap_ours()
        finally:
            tree.close()


def _collect(tree: ProcessTree, workers: Sequence[Worker], keep: set[int], adopted: bool) -> None:
    tree.add_descendants(w.pid for w in workers if not w.reaped)
    if adopted:
        tree.add_adopted(keep)


def _reap(workers: Sequence[Worker], kill_wait: float) -> None:
    for worker in workers:
        if worker.poll_exit() is not None:
            worker.reap()
        elif not worker.reaped:  # uninterruptible sleep: SIGKILL is pending until it ends
            logger.error("worker pid %d survived SIGKILL for %.1f s; it is reaped by a "
                         "later stop", worker.pid, kill_wait)
            _lingering[worker.pid] = worker


def _reap_lingering() -> None:
    """Reap the lingering workers that have died since (the guardian forgets them first)."""
    for pid, worker in list(_lingering.items()):
        if worker.reaped or worker.poll_exit() is not None:
            worker.reap()
            del _lingering[pid]
            logger.info("worker pid %d that survived SIGKILL is reaped", pid)


def _is_dead(pid: int) -> bool:
    """Whether our child ``pid`` has exited (a zombie), without reaping it."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
    except ChildProcessError:
        return False
    return info is not None and info.si_pid != 0


async def _wait_all_or(
    workers: Sequence[Worker], timeout: float | None, kill_now: anyio.Event | None
) -> None:
    """Wait until every worker exited, the timeout elapsed, or kill_now is set."""
    with anyio.move_on_after(timeout) as scope:
        async with anyio.create_task_group() as tg:
            if kill_now is not None:

                async def escalate() -> None:
                    await kill_now.wait()
                    scope.cancel()

                tg.start_soon(escalate)

            # each worker's monitor task is its only pidfd waiter; it sets ``exited``
            for worker in workers:
                if not worker.reaped:
                    await worker.exited.wait()
            tg.cancel_scope.cancel()
