"""The first attempt's standbys: with ``--preload`` under the daemon, the fork server
imports while the rendezvous forms (``warm_up``, at the supervisor's start) and a standby
per rank is forked from it before the first launch (``run``), so that the first attempt
too starts warm; its launch waits for them (``settle``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from supervisor.workers.warm.base import Preview
from supervisor.workers.warm.forkserver import ForkServerConfig
from supervisor.workers.warm.standby import standby_env
from supervisor.workers.warm.standbyset import StandbyPlan, StandbySet
from supervisor.workers.warm.supply import StandbyRequest

if TYPE_CHECKING:
    from supervisor.workers.warm.autolearn import AutoLearner
    from supervisor.workers.warm.forkslot import ForkSlot

logger = logging.getLogger(__name__)


class FirstStandbys:
    """The standbys forked for the first attempt before its launch.

    ``config_for``: the node's fork server for a preview's command (None: it cannot run
    warm); ``start``: how the pool starts a plan; ``begun``: whether an attempt began
    (then none is forked: that attempt's launch got its own)."""

    def __init__(self, forks: ForkSlot, standbys: StandbySet, learner: AutoLearner, *,
                 config_for: Callable[[Preview], ForkServerConfig | None],
                 start: Callable[[StandbyPlan], Awaitable[None]],
                 begun: Callable[[], bool]) -> None:
        self.forks = forks
        self.standbys = standbys
        self.learner = learner
        self.config_for = config_for
        self.start = start
        self.begun = begun
        self._preview: Preview | None = None  # the first attempt's ranks (``warm_up``)
        self._previewed = anyio.Event()
        self._forked = anyio.Event()  # ``run`` forked or gave up

    def warm_up(self, preview: Preview) -> None:
        """Have the fork server import for the command the first attempt will run (the
        explicit ``--preload`` list, and the ``auto`` list an earlier run kept)."""
        config = self.config_for(preview)
        if config is not None:
            self.forks.request(config)
            self._preview = preview
            self._previewed.set()

    async def settle(self) -> None:
        """Before the first launch: wait for the fork server ``warm_up`` started (its
        import: one per node instead of one per rank) and for the standbys ``run`` forks
        from it, in which the first attempt's ranks start. A preload that fails means cold
        starts (the slot warned and counted it); a rank whose environment is not the
        node's starts cold."""
        if not self._previewed.is_set() or self._forked.is_set():
            return
        config = None if self._preview is None else self.config_for(self._preview)
        importing = None if config is None else self.forks.importing_for(config)
        logger.info("the first attempt waits for the fork server's import%s",
                    "" if importing is None else f" (importing for {importing:.1f} s)")
        await self._forked.wait()

    async def run(self) -> None:
        """Fork a standby per rank as soon as the fork server that ``warm_up`` asked for is
        ready, if no attempt has begun yet: the first attempt (a spare's, when it is
        admitted) starts in them."""
        try:
            await self._previewed.wait()
            await self._fork()
        finally:
            self._forked.set()

    async def _fork(self) -> None:
        preview = self._preview
        config = None if preview is None else self.config_for(preview)
        if preview is None or config is None or not await self.forks.prepare(config) \
                or self.begun():
            return
        wanted = [
            StandbyRequest(rank, standby_env(env), None, cpus, Path(), 0, False,
                           frozenset(self.learner.excluded), config.path0)
            for rank, (env, cpus) in enumerate(zip(preview.envs, preview.cpus, strict=True))
            if rank not in self.standbys.held
        ]
        plan = self.standbys.plan(wanted)
        if wanted:
            logger.debug("forking %d standby(s) for the first attempt while the "
                         "rendezvous forms", len(wanted))
            await self.start(plan)
