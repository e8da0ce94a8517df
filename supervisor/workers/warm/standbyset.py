"""The standbys a pool holds, one per local rank, and the starting of planned ones.

``StandbySet.start`` supplies a plan's standbys (``supply.Supplier``): those the fork
server forks in one request, the others one at a time; it keeps each for its rank, has
the guardian watch it and hears its one report the moment it comes. A stop halts the
plans in flight (``halt``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import anyio
from anyio.abc import TaskGroup

from supervisor.workers.guardian import Guardian
from supervisor.workers.spawn import Spawner
from supervisor.workers.warm.standby import SETUP_WAIT, Standby, discard_all
from supervisor.workers.warm.supply import StandbyRequest, Supplier

logger = logging.getLogger(__name__)

STAGGER = 0.03  # s at most between two standbys' starts (see ``StandbySet.start``)


@dataclass
class StandbyPlan:
    """Standbys about to be started, one at a time; ``done`` once no more will be.

    ``halt`` (a stop began) starts no further one and ends the pause between two."""

    wanted: list[StandbyRequest]
    done: anyio.Event = field(default_factory=anyio.Event)
    started: bool = False
    halted: bool = False
    pause: anyio.CancelScope | None = None

    def halt(self) -> None:
        self.halted = True
        if self.pause is not None:
            self.pause.cancel()


class StandbySet:
    """The standbys held for the next attempt, by local rank.

    ``on_failed``: called with a standby whose report says its preload failed (the pool
    notes why, ``drop``s it and may ask for another)."""

    def __init__(self, spawner: Spawner, guardian: Guardian | None,
                 on_failed: Callable[[Standby, str], Awaitable[None]]) -> None:
        self.spawner = spawner  # forks every started standby (spawn.Spawner says why)
        self.guardian = guardian
        self.on_failed = on_failed
        self.held: dict[int, Standby] = {}  # local rank -> its warm interpreter
        self._reported: dict[int, anyio.Event] = {}  # local rank -> set once it reported
        self.plans: list[StandbyPlan] = []  # being started (or about to be)

    def plan(self, wanted: list[StandbyRequest]) -> StandbyPlan:
        """A plan for ``wanted``, under way at once: a stop that begins before ``start``
        is done waits for it before it sweeps, or it would take a new standby for debris."""
        plan = StandbyPlan(wanted)
        if wanted:
            self.plans.append(plan)
        else:
            plan.done.set()
        return plan

    def drop_plan(self, plan: StandbyPlan) -> None:
        """A plan that will start nothing."""
        plan.done.set()
        if plan in self.plans:
            self.plans.remove(plan)

    async def start(self, plan: StandbyPlan,
                    forked: tuple[Supplier, Sequence[StandbyRequest]] | None,
                    started: tuple[Supplier, Sequence[StandbyRequest]]) -> None:
        """Start the planned standbys: ``forked``'s in one request (they set themselves up
        one after another: ``forkserver_main._fork_each``), ``started``'s one at a time,
        each once the one before it has reported (started, and done preloading) or
        ``STAGGER`` s after it started.

        Each supply runs on the spawner thread (the loop stays responsive). One at a time
        because a new process, or thread, is not yet behind the workers in the kernel's
        queue (EEVDF places it as eligible, however low its priority): eight started at
        once on two CPUs took the CPU from our loop for tens of milliseconds per restart
        (``/healthz`` p99 2 to 5 times higher during restarts), one at a time they
        do not. A stop halts the plan and waits only for the supply in flight."""
        if not plan.wanted:
            return
        plan.started = True
        async with anyio.create_task_group() as tg:
            try:
                if forked is not None and forked[1]:
                    for standby in await self.spawner.spawn(forked[0].supply, forked[1]):
                        if standby is not None:
                            self._register(standby, tg)
                await self._one_at_a_time(plan, *started, tg)
            finally:
                plan.done.set()
                if plan in self.plans:
                    self.plans.remove(plan)

    async def _one_at_a_time(self, plan: StandbyPlan, supplier: Supplier,
                             requests: Sequence[StandbyRequest], tg: TaskGroup) -> None:
        for request in requests:
            if plan.halted:
                break
            [one] = await self.spawner.spawn(supplier.supply, [request])
            if one is None:
                break
            reported = self._register(one, tg)
            with anyio.move_on_after(STAGGER) as plan.pause:
                if not plan.halted and reported is not None:
                    await reported.wait()
            plan.pause = None

    def _register(self, standby: Standby, tg: TaskGroup) -> anyio.Event | None:
        """Keep a new standby for its rank and watch for its report (the event is set when
        it comes); None: another plan's standby for the rank came first, this one goes."""
        if standby.local_rank in self.held:
            self.discard(standby)
            return None
        self.held[standby.local_rank] = standby
        if self.guardian is not None:
            self.guardian.watch(standby.pid)
        logger.debug("standby for local rank %d started as pid %d",
                     standby.local_rank, standby.pid)
        reported = self._reported[standby.local_rank] = anyio.Event()
        tg.start_soon(self._watch_report, standby, reported)
        return reported

    async def _watch_report(self, standby: Standby, reported: anyio.Event) -> None:
        """Hear the standby's report the moment it comes: started (and preloaded), or
        failed (``on_failed``)."""
        began = time.monotonic()
        try:
            await anyio.wait_readable(standby.sock)
        except (anyio.ClosedResourceError, OSError):
            return  # handed over or discarded meanwhile
        finally:
            reported.set()
        if not standby.preloading:
            return
        failure = standby.preload_failure()
        if failure is not None:
            await self.on_failed(standby, failure)
            return
        what = [*standby.preload, *(["auto"] if standby.auto_spec else [])]
        logger.info("standby for local rank %d preloaded %s in %.2f s",
                    standby.local_rank, ",".join(what), time.monotonic() - began)
        if standby.skipped:
            logger.debug("standby for local rank %d could not preload: %s",
                         standby.local_rank, standby.skipped)

    async def halt(self) -> None:
        """Start no further standby; wait for the supply in flight."""
        plans = list(self.plans)
        for plan in plans:
            plan.halt()
        for plan in plans:
            if plan.started:
                await plan.done.wait()
            elif plan in self.plans:  # halted before it began: it will start nothing
                self.plans.remove(plan)

    async def ready(self, local_rank: int) -> None:
        """Give the rank's forked standby, if it is still setting itself up (milliseconds,
        one after another in its batch), at most ``SETUP_WAIT`` s to report."""
        standby = self.held.get(local_rank)
        reported = self._reported.get(local_rank)
        if standby is None or not standby.forked or reported is None:
            return
        with anyio.move_on_after(SETUP_WAIT):
            await reported.wait()

    def take(self, local_rank: int) -> Standby | None:
        """The rank's standby, no longer held (its worker is about to start in it)."""
        self._reported.pop(local_rank, None)
        return self.held.pop(local_rank, None)

    def drop(self, standby: Standby) -> bool:
        """Discard ``standby`` if it is the one held for its rank; whether it was."""
        if self.held.get(standby.local_rank) is not standby:
            return False
        del self.held[standby.local_rank]
        self.discard(standby)
        return True

    def discard(self, standby: Standby) -> None:
        standby.discard()
        if self.guardian is not None:
            self.guardian.forget(standby.pid)

    def pids(self) -> set[int]:
        return {s.pid for s in self.held.values()}

    def close(self) -> None:
        """Kill and reap every standby held."""
        for pid in discard_all(self.held):
            if self.guardian is not None:
                self.guardian.forget(pid)
