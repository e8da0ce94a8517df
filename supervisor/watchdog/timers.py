"""The watchdog tailer: reads deadline requests from the FIFO and enforces them.

One task reads the FIFO when it is readable; one timer sleeps until the next deadline
and is woken early only when a nearer one arrives (no polling interval). A request is
accepted only from a live worker of the current attempt or one of its descendants; every
accepted request counts as that worker's progress. When a deadline passes, the worker
that posted it is escalated against (``escalate``): an optional hang dump (bounded), the
``on_expired`` callback (the controller turns it into a restart), the requested signal,
and SIGKILL after a grace if it is still alive. The supervisor itself or a process it
does not own is never signalled (torch's server SIGKILLs its own agent).
"""

from __future__ import annotations

import collections
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import anyio
import anyio.abc
import anyio.lowlevel
import msgspec

from supervisor.core.deadlines import (
    DEFAULT_MAX_SCOPES_PER_PID,
    PIPE_BUF,
    DeadlineTable,
    Expired,
    Rejected,
    RejectReason,
    TimerRequest,
    parse_request,
)
from supervisor.core.state import DeadlineExpired
from supervisor.core.statusview import ProgressTable
from supervisor.pids import pid_exists
from supervisor.watchdog.escalate import (
    ExpiryOutcome,
    HangDump,
    ProcessHandle,
    dump_hang,
    terminate,
)
from supervisor.watchdog.fifo import Batch, FifoReader, open_fifo_reader

logger = logging.getLogger(__name__)

Owner = Callable[[int], int | None]
"""pid -> local rank of the live worker of the current attempt that is or owns it
(``owners.OwnerCache``: a walk of /proc the first time, a look-up after)."""

# the most the tailer handles without letting the loop run: a flood of requests is worked
# off in slices this long (probes, signals and the timer run in between), never at once
SLICE = 0.01

ExpiredCallback = Callable[[DeadlineExpired], Awaitable[None]]


# ----------------------------------------------------------------------- configuration


class WatchdogConfig(msgspec.Struct, frozen=True):
    """How the watchdog escalates; the defaults suit production."""

    kill_grace: float = 5.0  # requested signal -> SIGKILL
    hang_dump: HangDump = msgspec.field(default_factory=HangDump)
    dump_path: Callable[[int, int], Path | None] | None = None  # (local_rank, pid) -> file
    max_scopes_per_pid: int = DEFAULT_MAX_SCOPES_PER_PID
    log_interval: float = 10.0  # rejected requests: at most one log line per reason per interval
    # the timer woke this much later than asked: the loop stalled (blocked, SIGSTOPped,
    # starved) and deadlines fell due while nothing, not even a renewal, could be seen
    stall_threshold: float = 1.0
    max_stall_grace: float = 30.0  # the most a stall can postpone a judgement


# ----------------------------------------------------------------------- counting


class WatchdogMetrics(Protocol):
    """Where the watchdog reports what it counts (e.g. Prometheus counters)."""

    def request_accepted(self) -> None: ...

    def request_rejected(self, reason: str) -> None: ...

    def deadline_expired(self, outcome: str) -> None: ...


@dataclass
class WatchdogStats:
    """In-memory counts, always kept; readable for ``/status`` and tests."""

    accepted: int = 0
    rejected: collections.Counter[str] = field(default_factory=collections.Counter)
    expired: collections.Counter[str] = field(default_factory=collections.Counter)
    stalls: int = 0  # times the timer woke late by over ``stall_threshold``
    postponed: int = 0  # deadlines given more time because of those stalls

    def request_accepted(self) -> None:
        self.accepted += 1

    def request_rejected(self, reason: str) -> None:
        self.rejected[reason] += 1

    def deadline_expired(self, outcome: str) -> None:
        self.expired[outcome] += 1


class RateLimitedLog:
    """Logs a warning per key at most once per interval, counting what it suppressed."""

    def __init__(
        self,
        log: logging.Logger,
        interval: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self._interval = interval
        self._clock = clock
        self._state: dict[str, tuple[float, int]] = {}

    def warning(self, key: str, msg: str, *args: object) -> bool:
        """Log unless ``key`` was logged within the interval; returns whether it logged."""
        now = self._clock()
        last, suppressed = self._state.get(key, (-math.inf, 0))
        if now - last < self._interval:
            self._state[key] = (last, suppressed + 1)
            return False
        if suppressed:
            msg += " (%d similar suppressed)"
            args = (*args, suppressed)
        self._log.warning(msg, *args)
        self._state[key] = (now, 0)
        return True


# ----------------------------------------------------------------------- processes




# ----------------------------------------------------------------------- the tailer


class Watchdog:
    """The deadline tailer task and its table; the controller drives it between attempts.

    Run it with ``await tg.start(watchdog.run)``: that returns the FIFO path once the FIFO
    is open (hand it to workers as ``TORCHELASTIC_TIMER_FILE``). All methods are called
    from the event loop thread; none blocks.
    """

    def __init__(
        self,
        fifo_path: Path,
        owner: Owner,
        progress: ProgressTable,
        on_expired: ExpiredCallback,
        config: WatchdogConfig | None = None,
        metrics: WatchdogMetrics | None = None,
    ) -> None:
        self._path = fifo_path
        self._owner = owner
        self._progress = progress
        self._on_expired = on_expired
        self._config = config or WatchdogConfig()
        # told of each count as it happens (tests wait on it); the HTTP metrics, which
        # load after the first launch, read ``stats`` instead
        self._metrics = metrics
        self._table = DeadlineTable(self._config.max_scopes_per_pid)
        self._rate_log = RateLimitedLog(logger, self._config.log_interval)
        self._wakeup = anyio.Event()
        self._timer_target = math.inf
        self._escalations: set[anyio.CancelScope] = set()
        self._escalating: set[int] = set()  # pids
        self._tg: anyio.abc.TaskGroup | None = None
        self._reader: FifoReader | None = None
        self._backlog: collections.deque[bytes] = collections.deque()  # lines read, unhandled
        self._taken = 0  # lines ever queued
        self._handled = 0  # lines ever handled
        self._armed_at = 0.0  # monotonic: when the timer last went to sleep
        self.attempt = 0
        self.stats = WatchdogStats()

    # -- controller API ------------------------------------------------------------

    def reset(self, attempt: int) -> None:
        """A new attempt launches: forget every deadline and escalation of the last one."""
        self.clear()
        self.attempt = attempt

    def clear(self) -> None:
        """The group stopped: drop all deadlines, the requests read but not yet handled
        (they were posted for that group), and cancel escalations still running."""
        self._handled += len(self._backlog)  # a judgement waiting for them goes on
        self._backlog.clear()
        self._table.clear()
        for scope in self._escalations:
            scope.cancel()
        self._escalations.clear()
        self._escalating.clear()

    def forget_pid(self, pid: int) -> None:
        """A worker exited: its deadlines can no longer be honoured nor expire."""
        self._table.drop_pid(pid)

    def deadlines(self) -> list[tuple[int, str, float]]:
        """Live deadlines as (pid, scope, monotonic expiry), earliest first."""
        return [(d.pid, d.scope, d.expires_at) for d in self._table]

    # -- the task --------------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[Path] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Create and open the FIFO, report ready with its path, then tail it forever."""
        async with (
            open_fifo_reader(self._path, PIPE_BUF) as reader,
            anyio.create_task_group() as tg,
        ):
            self._tg, self._reader = tg, reader
            tg.start_soon(self._run_timer)
            task_status.started(reader.path)
            await self._tail(reader)

    async def _tail(self, reader: FifoReader) -> None:
        while True:
            if not self._backlog:
                self._take(await reader.receive())
            self._work_off()
            await anyio.lowlevel.checkpoint()  # a flood is handled a slice at a time

    def _take(self, batch: Batch) -> None:
        """Queue what the FIFO gave; handled by ``_work_off``."""
        for _ in range(batch.oversized):
            self._reject(Rejected(RejectReason.OVERSIZED, f"over {PIPE_BUF} bytes"), None)
        self._backlog.extend(batch.lines)
        self._taken += len(batch.lines)

    def _work_off(self) -> None:
        """Handle queued lines for at most ``SLICE`` seconds; the rest wait for the next."""
        if not self._backlog:
            return
        now_wall, now_mono = time.time(), anyio.current_time()
        until = time.monotonic() + SLICE
        while self._backlog:
            self._handle_line(self._backlog.popleft(), now_wall, now_mono)
            self._handled += 1
            if time.monotonic() >= until:
                break
        nearest = self._table.next_deadline()
        if nearest is not None and nearest < self._timer_target:
            self._wakeup.set()

    def _handle_line(self, line: bytes, now_wall: float, now_mono: float) -> None:
        request = parse_request(line)
        if isinstance(request, Rejected):
            self._reject(request, None)
            return
        rank = self._rank_of(request.pid)
        if isinstance(rank, Rejected):
            self._reject(rank, request)
            return
        if request.is_release:
            self._table.release(request.pid, request.scope)
        else:
            registered = self._table.register(request, rank, now_wall, now_mono)
            if isinstance(registered, Rejected):
                self._reject(registered, request)
                return
        self._progress.touch(rank, now_mono)
        self._count_accepted()

    def _rank_of(self, pid: int) -> int | Rejected:
        if pid == os.getpid():
            return Rejected(RejectReason.SUPERVISOR_PID, str(pid))
        rank = self._owner(pid)
        if rank is not None:
            return rank
        if not pid_exists(pid):
            return Rejected(RejectReason.DEAD_PID, str(pid))
        return Rejected(RejectReason.NOT_OWNED, str(pid))

    def _reject(self, rejected: Rejected, request: TimerRequest | None) -> None:
        self._count_rejected(rejected.reason)
        what = f"pid {request.pid} scope {request.scope!r}" if request else "line"
        self._rate_log.warning(rejected.reason.value, "dropped deadline request from %s: %s (%s)",
                               what, rejected.reason.value, rejected.detail)

    def _count_accepted(self) -> None:
        self.stats.request_accepted()
        if self._metrics is not None:
            self._metrics.request_accepted()

    def _count_rejected(self, reason: str) -> None:
        self.stats.request_rejected(reason)
        if self._metrics is not None:
            self._metrics.request_rejected(reason)

    def _count_expired(self, outcome: ExpiryOutcome) -> None:
        self.stats.deadline_expired(outcome.value)
        if self._metrics is not None:
            self._metrics.deadline_expired(outcome.value)

    # -- expiry ----------------------------------------------------------------------

    async def _run_timer(self) -> None:
        while True:
            self._wakeup = anyio.Event()
            nearest = self._table.next_deadline()
            self._timer_target = math.inf if nearest is None else nearest
            self._armed_at = anyio.current_time()
            with anyio.move_on_at(self._timer_target):
                await self._wakeup.wait()
            await self._judge(anyio.current_time())

    async def _judge(self, now: float) -> None:
        """Escalate against what expired, but only after hearing what the FIFO holds.

        After a stall the readiness callback of the FIFO may run after this timer (both
        became due while the loop stood still): read the FIFO first, and handle every line
        posted before now (a slice at a time, as the tailer does), so renewals that sat
        unread count; lines posted later do not hold the judgement up. A stall also
        postpones what fell due during it (``_ride_out``).
        """
        late = now - self._timer_target
        if late > self._config.stall_threshold:
            self._ride_out(late, now)
        if self._reader is not None:
            self._take(self._reader.read_now())
        posted = self._taken
        while self._handled < posted:
            self._work_off()
            await anyio.lowlevel.checkpoint()
        for expired in self._table.pop_expired(now):
            self._start_escalation(expired, now)

    def _ride_out(self, late: float, now: float) -> None:
        """The timer woke ``late`` seconds late: the loop stalled, and nothing could be
        observed meanwhile, not even a renewal (a worker may have been starved too, if
        the whole machine was, or its requests dropped while the FIFO was full). The stall
        began after the timer went to sleep and lasted at least ``late``: every deadline
        gets at least ``now - armed_at`` again (bounded by ``max_stall_grace``), before the
        FIFO is read, so that what a worker posted since still decides. A hung worker is
        still caught, at most that much later."""
        unobserved = max(late, now - self._armed_at)
        grace = min(unobserved, self._config.max_stall_grace)
        moved = self._table.postpone_until(now + grace)
        self.stats.stalls += 1
        self.stats.postponed += moved
        logger.warning("watchdog timer woke %.3f s late (the supervisor stalled): %d deadline(s) "
                       "get %.3f s more before they are judged", late, moved, grace)

    def _start_escalation(self, expired: Expired, now: float) -> None:
        pid = expired.pid
        if pid in self._escalating:
            return  # a hang already being handled; one failure, one escalation
        rank = self._owned_rank(pid)
        handle = ProcessHandle.open(pid) if rank is not None else None
        if rank is None or handle is None:
            logger.info("deadline %r of pid %d expired but it is no longer a worker: ignored",
                        expired.deadline.scope, pid)
            self._count_expired(ExpiryOutcome.DISOWNED)
            return
        logger.warning("deadline %r of local rank %d (pid %d) expired %.3f s ago",
                       expired.deadline.scope, rank, pid, expired.late)
        event = DeadlineExpired(self.attempt, rank, pid, expired.deadline.scope, expired.late, now)
        scope = anyio.CancelScope()
        self._escalations.add(scope)
        self._escalating.add(pid)
        assert self._tg is not None
        self._tg.start_soon(self._escalate, handle, event, expired.deadline.signal, scope)

    def _owned_rank(self, pid: int) -> int | None:
        return None if pid == os.getpid() else self._owner(pid)

    async def _escalate(
        self, handle: ProcessHandle, event: DeadlineExpired, signum: int, scope: anyio.CancelScope
    ) -> None:
        """Dump, report, signal, kill: dump first, so the controller's stop cannot race it."""
        attempt = event.attempt

        def still_owned() -> bool:
            return self.attempt == attempt and self._owned_rank(handle.pid) is not None

        try:
            with handle, scope:
                await dump_hang(handle, self._config.hang_dump, self._dump_path(event))
                if not still_owned():
                    self._count_expired(ExpiryOutcome.DISOWNED)
                    return
                await self._on_expired(event)
                outcome = await terminate(handle, signum, self._config.kill_grace, still_owned)
                logger.info("local rank %d (pid %d) after expiry: %s", event.local_rank,
                            handle.pid, outcome.value)
                self._count_expired(outcome)
        finally:
            self._escalations.discard(scope)
            self._escalating.discard(handle.pid)

    def _dump_path(self, event: DeadlineExpired) -> Path | None:
        if self._config.hang_dump.mode == "none" or self._config.dump_path is None:
            return None
        return self._config.dump_path(event.local_rank, event.pid)
