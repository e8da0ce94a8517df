"""Uninterruptible sleep (D state) detector.

A worker stuck in D (a dead NFS server, a wedged GPU driver) ignores every signal,
SIGKILL included: restarting cannot help and the node is unhealthy. No event announces
it, so this is the one periodic check in the supervisor: every ``interval`` seconds a
worker thread (reading ``/proc``, off the event loop) lists the workers and their
descendants in D. A process counts as stuck only while it is seen in D at every sample
with an unchanged context-switch count: one busy doing disk I/O enters and leaves D all
the time and its count moves. Stuck longer than ``hang_state_timeout`` is reported once
per episode through the callback (the controller turns it into ``WorkerUnhealthy``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

import anyio
import anyio.abc
import anyio.to_thread
import msgspec

from supervisor.core.state import WorkerUnhealthy
from supervisor.workers.proctree import children

logger = logging.getLogger(__name__)


class DSample(msgspec.Struct, frozen=True):
    """One process seen in D: the worker it belongs to and its context-switch count."""

    local_rank: int
    switches: int


class DStateTracker:
    """Pure timing: since when has each pid been stuck in D; reports each episode once."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._since: dict[int, tuple[float, int]] = {}  # pid -> (first seen, switches)
        self._reported: set[int] = set()

    def observe(self, now: float, in_d: Mapping[int, int]) -> list[tuple[int, float]]:
        """Feed one sample (pid -> context switches of each process in D).

        Returns ``(pid, seconds stuck)`` for pids stuck at least ``timeout`` and not yet
        reported in this episode, ordered by pid.
        """
        for pid in [pid for pid in self._since if pid not in in_d]:
            self._forget(pid)
        due: list[tuple[int, float]] = []
        for pid, switches in sorted(in_d.items()):
            since, seen = self._since.get(pid, (now, switches))
            if seen != switches:  # it ran in between: a new episode, not a hang
                since = now
                self._reported.discard(pid)
            self._since[pid] = (since, switches)
            if now - since >= self._timeout and pid not in self._reported:
                self._reported.add(pid)
                due.append((pid, now - since))
        return due

    def clear(self) -> None:
        self._since.clear()
        self._reported.clear()

    def _forget(self, pid: int) -> None:
        del self._since[pid]
        self._reported.discard(pid)


def sample_d_state(workers: Mapping[int, int]) -> dict[int, DSample]:
    """Processes in D among ``workers`` (pid -> local rank) and their descendants.

    Blocking (reads ``/proc``): run it in a worker thread.
    """
    found: dict[int, DSample] = {}
    for pid, rank in _ranks_of_descendants(workers).items():
        switches = _stuck_switches(pid)
        if switches is not None:
            found[pid] = DSample(rank, switches)
    return found


def _stuck_switches(pid: int) -> int | None:
    """``pid``'s context switches if it is in D now; None if not, or gone.

    Two reads of ``/proc/PID`` (what psutil's ``status()`` and ``num_ctx_switches()``
    read): psutil itself was 1.2 MiB of the supervisor's resident memory for this alone.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # "pid (comm) S ...": comm may hold spaces and parentheses, the state follows the last ")"
        if stat[stat.rindex(b")") + 2:][:1] != b"D":
            return None
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
    except (OSError, ValueError):
        return None  # exited meanwhile
    return sum(int(line.split()[1]) for line in status.splitlines()
               if line.startswith((b"voluntary_ctxt_switches:", b"nonvoluntary_ctxt_switches:")))


def _ranks_of_descendants(workers: Mapping[int, int]) -> dict[int, int]:
    """Every live process that is a worker or descends from one, mapped to its rank.

    Walks each worker's tree through /proc/PID/task/*/children: a few reads per worker
    instead of a scan of every process on the host.
    """
    rank_of: dict[int, int] = {}
    stack = list(workers.items())
    while stack:
        pid, rank = stack.pop()
        if pid not in rank_of:
            rank_of[pid] = rank
            stack.extend((child, rank) for child in children(pid))
    return rank_of


def default_interval(hang_state_timeout: float) -> float:
    """A modest sampling interval: a quarter of the timeout, within 0.5..15 s."""
    return min(max(hang_state_timeout / 4, 0.5), 15.0)


class DStateMonitor:
    """The periodic D-state check; start with ``await tg.start(monitor.run)``."""

    def __init__(
        self,
        workers: Callable[[], Mapping[int, int]],
        on_unhealthy: Callable[[WorkerUnhealthy], Awaitable[None]],
        *,
        hang_state_timeout: float,
        interval: float | None = None,
        sampler: Callable[[Mapping[int, int]], Mapping[int, DSample]] = sample_d_state,
    ) -> None:
        self._workers = workers
        self._on_unhealthy = on_unhealthy
        self._timeout = hang_state_timeout
        self._interval = interval if interval is not None else default_interval(
            hang_state_timeout
        )
        self._sampler = sampler
        self._tracker = DStateTracker(hang_state_timeout)
        self.attempt = 0

    def reset(self, attempt: int) -> None:
        """A new attempt launches: forget the last one's processes."""
        self.attempt = attempt
        self._tracker.clear()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        logger.info("D-state check every %.1f s, hang_state_timeout %.1f s",
                    self._interval, self._timeout)
        task_status.started()
        while True:
            await anyio.sleep(self._interval)
            await self.check_once()

    async def check_once(self) -> None:
        """Sample once and report what has been stuck too long."""
        workers = dict(self._workers())
        if not workers:
            self._tracker.clear()
            return
        attempt = self.attempt
        samples = await anyio.to_thread.run_sync(self._sampler, workers, abandon_on_cancel=True)
        if attempt != self.attempt:
            return  # the group changed while we looked
        now = anyio.current_time()
        in_d = {pid: sample.switches for pid, sample in samples.items()}
        for pid, stuck in self._tracker.observe(now, in_d):
            await self._report(pid, samples[pid].local_rank, stuck, now)

    async def _report(self, pid: int, rank: int, stuck: float, now: float) -> None:
        reason = f"pid {pid} in uninterruptible sleep (D) for {stuck:.1f} s"
        logger.error("local rank %d: %s", rank, reason)
        await self._on_unhealthy(WorkerUnhealthy(self.attempt, rank, pid, reason, now))
