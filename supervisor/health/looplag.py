"""Event-loop lag: how late a short sleep wakes up.

A task sleeps a short interval and records by how much it overshot. That periodic tick is
the measurement itself (a blocked loop cannot be seen from inside the loop any other
way), so it is the one place where sleeping a fixed interval is the point.

If the ticker itself stops ticking (the loop is blocked right now, or the task died),
``current()`` reports how overdue the next tick is, so the liveness verdict degrades
even without a fresh measurement.

A tick that overshoots by more than ``stall_threshold`` is a **stall**: the loop did not
run for that long (a blocking call, the process SIGSTOPped, the machine starved). So is a
tick across which ``CLOCK_BOOTTIME`` advanced more than the monotonic clock (the machine
was suspended: the monotonic clock stood still, the wall clock jumped). Each stall is
logged once as a warning, counted (``stalls``, ``stalled_seconds``) and passed to the
listeners (``add_listener``): the composition root writes it to the event log and the
metrics read the counts, so that an SRE sees why things happened around it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskStatus

logger = logging.getLogger(__name__)

# one wake-up every 2 s: a blocked loop still shows within ~2 s (liveness judges progress
# over 60 s by default), and an idle supervisor stays near zero CPU
DEFAULT_INTERVAL = 2.0
# a loop that did not run for a second is worth an event; ordinary lag on a loaded
# 2-core machine stays well below (tens to a few hundred milliseconds)
DEFAULT_STALL_THRESHOLD = 1.0


def boottime() -> float:
    """Seconds since boot, counting time suspended (the monotonic clock does not)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


class Stall(msgspec.Struct, frozen=True):
    """One stall: the loop did not run (``kind`` "stall") or the machine was suspended
    (``kind`` "suspend") for about ``seconds``, noticed at ``at`` (monotonic)."""

    kind: str
    seconds: float
    at: float

    def fields(self) -> dict[str, Any]:
        """The event-log fields (``events.emit("loop_stall", **stall.fields())``)."""
        return {"cause": self.kind, "seconds": round(self.seconds, 3)}


StallListener = Callable[[Stall], object]  # what it returns is ignored


class LoopLag:
    """The latest measured event-loop lag in seconds; ``run`` keeps it up to date."""

    def __init__(
        self,
        interval: float = DEFAULT_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
        *,
        stall_threshold: float = DEFAULT_STALL_THRESHOLD,
        boot_clock: Callable[[], float] = boottime,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be positive, got {interval!r}")
        self.interval = interval
        self.stall_threshold = stall_threshold
        self._clock = clock
        self._boot_clock = boot_clock
        self._lag = 0.0
        self._last_tick: float | None = None
        self._ticked = anyio.Event()
        self._listeners: list[StallListener] = []
        self.stalls = 0
        self.stalled_seconds = 0.0
        self.last_stall: Stall | None = None

    def add_listener(self, listener: StallListener) -> None:
        """Call ``listener(stall)`` for every stall from now on (it must not block)."""
        self._listeners.append(listener)

    def current(self, now: float | None = None) -> float:
        """The lag to report now: the last overshoot, or how overdue the next tick is."""
        if self._last_tick is None:
            return 0.0
        now = self._clock() if now is None else now
        overdue = now - self._last_tick - self.interval
        return max(self._lag, overdue, 0.0)

    def record(
        self, slept_from: float, woke_at: float, boot_slept: float | None = None,
        boot_woke: float | None = None,
    ) -> float:
        """Record one tick: a sleep of ``interval`` started at ``slept_from``.

        ``boot_slept``/``boot_woke`` are ``CLOCK_BOOTTIME`` readings taken with the two
        monotonic ones; when given, a suspend of the machine is noticed too.
        """
        self._lag = max(0.0, woke_at - slept_from - self.interval)
        self._last_tick = woke_at
        suspended = 0.0
        if boot_slept is not None and boot_woke is not None:
            suspended = (boot_woke - boot_slept) - (woke_at - slept_from)
        if self._lag > self.stall_threshold:
            self._stalled(Stall("stall", self._lag, woke_at))
        elif suspended > self.stall_threshold:
            self._stalled(Stall("suspend", suspended, woke_at))
        ticked, self._ticked = self._ticked, anyio.Event()
        ticked.set()
        return self._lag

    def _stalled(self, stall: Stall) -> None:
        self.stalls += 1
        self.stalled_seconds += stall.seconds
        self.last_stall = stall
        what = "the machine was suspended" if stall.kind == "suspend" else "event loop stalled"
        logger.warning("%s for %.3f s (nothing could be observed meanwhile)", what, stall.seconds)
        for listener in self._listeners:
            try:
                listener(stall)
            except Exception:  # a reporting bug must not stop the measurement
                logger.exception("loop stall listener failed")

    async def next_tick(self) -> float:
        """Wait for the next measurement and return it (used by tests and tools)."""
        await self._ticked.wait()
        return self._lag

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Measure forever. Started as soon as the overdue clock runs."""
        self._last_tick = self._clock()
        task_status.started()
        while True:
            slept_from, boot_slept = self._clock(), self._boot_clock()
            await anyio.sleep(self.interval)
            lag = self.record(slept_from, self._clock(), boot_slept, self._boot_clock())
            if lag > self.interval:
                logger.debug("event loop lag %.3f s", lag)
