"""Event-loop lag: how late a short sleep wakes up.

A task sleeps a short interval and records by how much it overshot. That periodic tick is
the measurement itself (a blocked loop cannot be seen from inside the loop any other
way), so it is the one place where sleeping a fixed interval is the point.

If the ticker itself stops ticking (the loop is blocked right now, or the task died),
``current()`` reports how overdue the next tick is, so the liveness verdict degrades
even without a fresh measurement.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import anyio
from anyio.abc import TaskStatus

logger = logging.getLogger(__name__)

# one wake-up every 2 s: a blocked loop still shows within ~2 s (liveness judges progress
# over 60 s by default), and an idle supervisor stays near zero CPU
DEFAULT_INTERVAL = 2.0


class LoopLag:
    """The latest measured event-loop lag in seconds; ``run`` keeps it up to date."""

    def __init__(
        self,
        interval: float = DEFAULT_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be positive, got {interval!r}")
        self.interval = interval
        self._clock = clock
        self._lag = 0.0
        self._last_tick: float | None = None
        self._ticked = anyio.Event()

    def current(self, now: float | None = None) -> float:
        """The lag to report now: the last overshoot, or how overdue the next tick is."""
        if self._last_tick is None:
            return 0.0
        now = self._clock() if now is None else now
        overdue = now - self._last_tick - self.interval
        return max(self._lag, overdue, 0.0)

    def record(self, slept_from: float, woke_at: float) -> float:
        """Record one tick: a sleep of ``interval`` started at ``slept_from``."""
        self._lag = max(0.0, woke_at - slept_from - self.interval)
        self._last_tick = woke_at
        ticked, self._ticked = self._ticked, anyio.Event()
        ticked.set()
        return self._lag

    async def next_tick(self) -> float:
        """Wait for the next measurement and return it (used by tests and tools)."""
        await self._ticked.wait()
        return self._lag

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Measure forever. Started as soon as the overdue clock runs."""
        self._last_tick = self._clock()
        task_status.started()
        while True:
            slept_from = self._clock()
            await anyio.sleep(self.interval)
            lag = self.record(slept_from, self._clock())
            if lag > self.interval:
                logger.debug("event loop lag %.3f s", lag)
