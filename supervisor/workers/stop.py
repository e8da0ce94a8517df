"""Stopping a worker group: signal -> grace -> SIGKILL -> sweep descendants -> reap.

One shielded function does the whole escalation, so a cancelled caller never leaves a
half-stopped group behind. Workers stay unreaped (zombies) until the sweep is done, so
their process group ids cannot be recycled while we signal them.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterable, Sequence

import anyio
import psutil

from supervisor.workers.spawn import Worker

logger = logging.getLogger(__name__)

KILL_WAIT = 5.0  # seconds to wait for SIGKILLed workers before giving up on them


def descendants(pids: Iterable[int]) -> list[psutil.Process]:
    """Every live descendant of the given pids (grandchildren included)."""
    found: dict[int, psutil.Process] = {}
    for pid in pids:
        try:
            for child in psutil.Process(pid).children(recursive=True):
                found[child.pid] = child
        except psutil.Error:
            continue
    return list(found.values())


def adopted_orphans(exempt: Iterable[int]) -> list[psutil.Process]:
    """Processes reparented to us (we are a child subreaper) that are not ours to keep."""
    keep = set(exempt)
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    return [c for c in children if c.pid not in keep]


def kill_processes(procs: Iterable[psutil.Process], signum: int = signal.SIGKILL) -> int:
    """Signal each process if it is still the same process (psutil checks create time)."""
    count = 0
    for proc in procs:
        try:
            proc.send_signal(signum)
            count += 1
        except psutil.Error:
            continue
    return count


def reap_adopted(exempt: Iterable[int]) -> None:
    """Collect zombies of adopted orphans, by pid only (never waitpid(-1): that could
    reap a worker whose exit status the monitor has not read yet)."""
    keep = set(exempt)
    try:
        children = psutil.Process().children()
    except psutil.Error:
        return
    for child in children:
        if child.pid in keep:
            continue
        try:
            os.waitpid(child.pid, os.WNOHANG)
        except ChildProcessError:
            continue


async def stop_group(
    workers: Sequence[Worker],
    *,
    signum: int,
    grace: float,
    kill_now: anyio.Event,
    sweep_adopted: bool,
    exempt: Iterable[int] = (),
) -> None:
    """Stop every worker and every descendant; return once all are reaped."""
    with anyio.CancelScope(shield=True):
        tree = descendants(w.pid for w in workers if w.poll_exit() is None)
        for worker in workers:
            worker.signal_group(signum)
        kill_processes(tree, signum)
        await _wait_all_or(workers, grace, kill_now)
        # the rest of the tree may have changed during the grace: look again
        tree = descendants(w.pid for w in workers if w.poll_exit() is None) + tree
        for worker in workers:
            worker.signal_group(signal.SIGKILL)
        kill_processes(tree)
        await _wait_all_or(workers, KILL_WAIT, None)
        keep = {w.pid for w in workers} | set(exempt)
        if sweep_adopted:
            kill_processes(adopted_orphans(keep))
        for worker in workers:
            if worker.poll_exit() is not None:
                worker.reap()
            else:  # uninterruptible sleep: SIGKILL is pending until the kernel lets go
                logger.error("worker pid %d survived SIGKILL for %.0f s", worker.pid, KILL_WAIT)
        if sweep_adopted:
            reap_adopted(keep)


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
