"""The warm pool: the standbys of one supervisor's local ranks, for the next attempt.

``WarmPool`` is the ``base.Pool`` of a run that can use standbys. It follows the attempt
(begins, launched, runs, stops) and acts on what ``core.warm`` decides: when standbys
come and for which ranks, from where (``supply``: forked from the node's fork server, or
started to import for themselves), why a rank starts cold, when a warm rank waits for
rank 0's store and how long a restart waits for a fork server still importing. It holds
them in a ``StandbySet``, has ``AutoLearner`` learn ``--preload auto``'s lists and, with
``--preload`` under the daemon, has the fork server import before the first attempt so
that it too starts warm. The worker group asks it for a rank's worker (``take``).
``base.NullPool`` is the pool of ``--no-warm-restart``, of runs that can have no second
attempt, and of tests of the group alone. The rules are in docs/design.md ("Warm
restarts").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread
from anyio.abc import TaskGroup

from supervisor.config import Settings
from supervisor.core import warm
from supervisor.core.envs import PER_RANK_ENV, fork_server_env, interpreter
from supervisor.core.statusview import ProgressTable
from supervisor.workers.guardian import Guardian
from supervisor.workers.spawn import SPAWNER, DeathSignal, Spawner, Start, Worker, WorkerSpec
from supervisor.workers.warm import autopreload
from supervisor.workers.warm.autolearn import AutoLearner
from supervisor.workers.warm.base import Preview
from supervisor.workers.warm.firstattempt import FirstStandbys
from supervisor.workers.warm.forkserver import ForkServerConfig, cold_path0
from supervisor.workers.warm.standby import (
    PER_ATTEMPT_ENV,
    Standby,
    StandbyOptions,
    env_mismatch,
    standby_env,
)
from supervisor.workers.warm.standbyset import StandbyPlan, StandbySet
from supervisor.workers.warm.store import RankZeroStore
from supervisor.workers.warm.supply import ForkedSupply, SpawnedSupply, StandbyRequest

if TYPE_CHECKING:
    from supervisor.workers.group import Attempt
    from supervisor.workers.warm.forkslot import ForkSlot
    from supervisor.workers.warm.memory import MemorySample, MemorySampler

logger = logging.getLogger(__name__)

AUTO_SETTLE = 5.5  # s after a launch: a warm worker has recorded its imports at 1 and 5 s
# s after a launch at the latest that standbys importing for themselves (no fork server:
# the embedded API, a rank whose environment differs) start, for a job that shows no
# progress (they start once every rank has shown some)
PRELOAD_AFTER = 5.0


class WarmPool:
    """The standbys of one supervisor's local ranks, for the attempt after the current one."""

    def __init__(
        self,
        settings: Settings,
        *,
        python: str,
        death: DeathSignal,
        progress: ProgressTable,
        membership_can_change: bool,
        guardian: Guardian | None = None,
        forks: ForkSlot | None = None,
        spawner: Spawner = SPAWNER,
        run_dir: Path | None = None,
    ) -> None:
        self.settings = settings
        self.python = python
        self.progress = progress
        self.membership_can_change = membership_can_change
        explicit = tuple(m for m in settings.preload if m != "auto")
        self.options = StandbyOptions(preload=explicit, auto="auto" in settings.preload)
        # --preload auto under the fork server: the node's list an earlier run kept here
        self.learner = AutoLearner(run_dir if self.options.auto and forks is not None
                                   else None)
        # the node's fork server (--preload under the daemon): standbys are forked from it
        self.forks = forks
        self.forked = ForkedSupply(forks, python) if forks is not None else None
        self.spawned = SpawnedSupply(python, death, self.options, self.learner)
        self.standbys = StandbySet(spawner, guardian, self._standby_failed)
        self.sampler: MemorySampler | None = None
        if forks is not None:  # the fork server's modules: only for runs that use it
            from supervisor.workers.warm.memory import MemorySampler

            self.sampler = MemorySampler(self.memory_targets)
        self.cold = warm.ColdReasons()
        self.taints = warm.TaintRetries()
        self._preparing: StandbyPlan | None = None  # due from a server being prepared
        self._attempt: Attempt | None = None  # the one being started, then running
        self._due: StandbyPlan | None = None  # planned at the launch, started by ``run``
        self.store = RankZeroStore()
        self._launched_at = 0.0  # monotonic time of the last launch
        # launch -> every rank's first progress of this node's last cold attempt
        self.cold_startup: float | None = None
        self._waited_for: int | None = None  # the importing server a restart waited for
        progress.listeners.append(self._on_progress)
        self.first = None if forks is None else FirstStandbys(
            forks, self.standbys, self.learner, start=self._start,
            config_for=lambda p: self._config_for(p.argv, None, p.envs),
            begun=lambda: self._attempt is not None)

    @property
    def preloading(self) -> bool:
        """Whether standbys import modules before they wait (``--preload``)."""
        return bool(self.options.preload) or self.options.auto

    @property
    def forking(self) -> bool:
        """Whether standbys are forked from the node's fork server."""
        return self.forks is not None and self.preloading and not self.forks.given_up

    def restart_possible(self, restart_count: int) -> bool:
        """Whether another attempt may follow this one (``core.warm.attempt_may_follow``)."""
        return warm.attempt_may_follow(restart_count, self.settings.max_restarts,
                                       self.membership_can_change)

    # ------------------------------------------------------------------ the attempt
    def begin(self, attempt: Attempt) -> None:
        self._attempt = attempt
        preparing = self._preparing
        if preparing is not None and self.forks is not None and self.forks.preload_failing:
            # the last attempt ended while these standbys waited for a new server, the
            # last one's preload having failed
            self.cold.begin(w.rank for w in preparing.wanted)
        else:
            self.cold.begin()

    def launched(self, attempt: Attempt) -> None:
        """Plan the standbys that come right after the launch now, before any event of
        this attempt is handled (``core.warm.plan_at_launch``)."""
        self._launched_at = time.monotonic()
        self._due = None
        if warm.plan_at_launch(self.restart_possible(attempt.layout.restart_count),
                               self.preloading, self.forking):
            self._due = self._plan(attempt)

    async def run(self, attempt: Attempt) -> None:
        due, self._due = self._due, None
        supply = warm.supply_after_launch(self.restart_possible(attempt.layout.restart_count),
                                          due is not None, self.forking)
        if supply is warm.Supply.FORK and due is not None:
            await self._fork_standbys(attempt, due)
        elif supply is warm.Supply.START and due is not None:
            await self._start(due)
        elif supply is warm.Supply.WHEN_RESUMED:
            await self._preload_when_resumed(attempt)

    async def halt(self, attempt: Attempt | None = None) -> None:
        await self.standbys.halt()
        if attempt is not None and attempt.workers:
            self._learn_store(attempt)

    # ------------------------------------------------------------------ forked standbys
    async def _prepare(self, config: ForkServerConfig, due: StandbyPlan) -> bool:
        """``forks.prepare``, with ``due`` known to ``begin`` meanwhile."""
        assert self.forks is not None
        self._preparing, self.cold.counted_early = due, False
        try:
            return await self.forks.prepare(config)
        finally:
            self._preparing = None

    async def _fork_standbys(self, attempt: Attempt, due: StandbyPlan) -> None:
        """Fork the next attempt's standbys right after the launch (milliseconds each),
        from the fork server once it is ready; with ``auto``, learn the node's list from
        the first attempt's workers, have a server import it, and fork again from it."""
        assert self.forks is not None
        config = self._fork_config(attempt)
        if config is None:
            self.standbys.drop_plan(due)
            return
        if self.forks.usable_for(config):
            self.forks.request(config)  # a replacement, if the list changed: later
        elif not config.preload and not config.auto_names:
            self.standbys.drop_plan(due)  # auto, nothing learned yet: no server to fork from
        elif not await self._prepare(config, due):
            self.standbys.drop_plan(due)  # cold starts; a new server at the next launch
            self.cold.preload_failed(w.rank for w in due.wanted)  # once
            if self.forks.given_up:  # as without the fork server, from now on
                await self._preload_when_resumed(attempt)
            return
        if not due.halted:
            await self._start(due)
            if self._died_at_fork(due) and await self.forks.prepare(config) \
                    and self._attempt is attempt and _running(attempt):
                await self._start(self._plan(attempt))  # from its replacement, at once
        if self.options.auto and self.learner.due(attempt):
            await self._learn_auto(attempt)

    def _died_at_fork(self, plan: StandbyPlan) -> bool:
        """Whether the server was found unusable when asked for ``plan``'s standbys (killed
        since its last fork, or not answering): a replacement is started then, not at
        the next launch, so that the next attempt does not start cold too."""
        assert self.forks is not None
        return (not plan.halted and self.forks.server is None and not self.forks.given_up
                and any(w.rank not in self.standbys.held for w in plan.wanted))

    async def _learn_auto(self, attempt: Attempt) -> None:
        """``--preload auto`` learns for the node from the attempt's workers once they
        recorded their imports (``AutoLearner``); a new server imports the list, then the
        standbys forked before are forked again from it."""
        assert self.forks is not None and self.forked is not None
        launched = time.monotonic()
        await anyio.sleep(max(0.0, launched + AUTO_SETTLE - time.monotonic()))
        if not _running(attempt):
            return
        if not await anyio.to_thread.run_sync(self.learner.learn_node, attempt):
            return  # nothing new: the server there is the one to keep
        kept = self.learner.to_keep(self.forks.excluded)
        if kept is not None:
            await anyio.to_thread.run_sync(autopreload.keep, *kept)
        config = self._fork_config(attempt)
        if config is None or not await self.forks.prepare(config):
            return
        server = self.forks.server
        for rank in warm.stale_forks(self.forked.forked_from,
                                     None if server is None else server.pid):
            standby = self.standbys.take(rank)  # forked before the list was learned
            if standby is not None:
                self.standbys.discard(standby)
        if self._attempt is attempt and _running(attempt):
            await self._start(self._plan(attempt))

    def warm_up(self, preview: Preview | None) -> None:
        """At the supervisor's start (while the rendezvous forms), with ``--preload``
        under the daemon: the first attempt's standbys (``FirstStandbys``). With ``auto``
        and nothing kept, a server with nothing preloaded: the first attempt's forked
        workers then record every module they import (a cold one shows only its shared
        libraries), so the first restart gets them all."""
        if preview is not None and self.forking and self.first is not None:
            self.first.warm_up(preview)

    def _on_progress(self, attempt: int, _local_rank: int, now: float) -> None:
        """Learn how long a cold start takes on this node (``settle`` weighs it)."""
        current = self._attempt
        if current is None or current.number != attempt:
            return
        if warm.cold_startup_seen(not any(w.start.warm for w in current.workers),
                                  len(current.workers), self.progress.count()):
            self.cold_startup = now - self._launched_at

    async def settle(self) -> None:
        """Before a restart's launch, for ranks that have no standby: fork them from the
        ready server (it got ready after the stop halted their forks), or wait for the
        server still importing, when that is sooner than a cold start.

        Sooner: the server began importing before the attempt that just stopped, so it is
        ahead of a cold worker that would import the same modules from nothing; it is
        waited for at most ``core.warm.settle_wait``, and then the ranks start cold, the
        import going on for the next restart. One server is waited for once: a preload
        that hangs delays one restart, not every one. Before the first launch:
        ``FirstStandbys.settle``."""
        attempt = self._attempt
        if attempt is None:
            if self.first is not None:
                await self.first.settle()
            return
        if self.forks is None or not self.forking or not attempt.workers \
                or all(w.local_rank in self.standbys.held for w in attempt.workers):
            return
        config = self._fork_config(attempt)
        if config is None:
            return
        if not self.forks.usable_for(config) and not await self._wait_for_import(config):
            return
        await self._start(self._plan(attempt))

    async def _wait_for_import(self, config: ForkServerConfig) -> bool:
        """Wait for the server importing for ``config`` (``settle``); whether it is ready."""
        assert self.forks is not None
        importing = self.forks.importing_for(config)
        pending = self.forks.pending_pid()
        if importing is None or pending == self._waited_for:
            return False  # no server on its way (or it already kept a restart waiting)
        self._waited_for = pending
        limit, known = warm.settle_wait(self.cold_startup, self.forks.import_seconds)
        logger.info("waiting for the fork server (importing for %.1f s) rather than "
                    "starting cold%s", importing,
                    f" (at most {limit:.1f} s, a cold start)" if known else "")
        ready = False
        with anyio.move_on_after(limit):
            ready = await self.forks.prepare(config)
        if not ready:
            logger.info("the fork server is not ready: the ranks start cold")
        return ready

    def _fork_config(self, attempt: Attempt) -> ForkServerConfig | None:
        """The node's fork server for this attempt's command (None: it cannot run warm)."""
        workers = attempt.workers
        if not workers:
            return None
        first = workers[0].spec
        return self._config_for(first.argv, first.cwd, [w.spec.env for w in workers])

    def _config_for(self, argv: Sequence[str], cwd: str | None,
                    envs: list[dict[str, str]]) -> ForkServerConfig | None:
        prefix = interpreter(self.python)
        if not Standby.accepts(prefix, argv):
            return None
        env = fork_server_env([standby_env(e) for e in envs])
        return ForkServerConfig(
            python=self.python, env=env, cwd=cwd,
            path0=cold_path0(list(argv[len(prefix):]), cwd, env),
            preload=self.options.preload, auto_names=tuple(self.learner.node or ()),
            exclude=frozenset(self.learner.excluded),
            watch=(*PER_ATTEMPT_ENV, *PER_RANK_ENV),
        )

    async def start_tasks(self, tg: TaskGroup) -> None:
        """The run-long tasks of the fork server: its slot, the memory sampler."""
        if self.forks is not None:
            await tg.start(self.forks.run)
        if self.first is not None:
            tg.start_soon(self.first.run)
        if self.sampler is not None:
            tg.start_soon(self.sampler.run)

    def memory(self) -> MemorySample | None:
        return self.sampler.last if self.sampler is not None else None

    def memory_targets(self) -> tuple[int | None, dict[int, int]]:
        """What the sampler reads: the ready fork server, the forked standbys."""
        server = self.forks.server if self.forks is not None else None
        forked = self.forked.forked_from if self.forked is not None else {}
        return (server.pid if server is not None else None,
                {r: s.pid for r, s in self.standbys.held.items() if r in forked})

    def fork_failures(self) -> dict[str, int]:
        return dict(self.forks.failures) if self.forks is not None else {}

    # ------------------------------------------------------------------ starting standbys
    async def _preload_when_resumed(self, attempt: Attempt) -> None:
        """Preloading standbys for the next attempt, once this one has resumed.

        A standby that imports a framework costs seconds of CPU: started at once, it would
        compete with the very ranks that are resuming. So they start when every rank has
        shown progress in this attempt, or ``PRELOAD_AFTER`` seconds after the launch for
        a job that shows none."""
        launched = time.monotonic()
        with anyio.move_on_after(PRELOAD_AFTER):
            await self._all_progressed(attempt)
        if self.options.auto:  # the workers' second record of their imports
            await anyio.sleep(max(0.0, launched + AUTO_SETTLE - time.monotonic()))
        if self._attempt is attempt and _running(attempt):
            self._learn_store(attempt)
            await self._start(self._plan(attempt))

    async def _all_progressed(self, attempt: Attempt) -> None:
        """Return once every local rank of ``attempt`` has shown progress."""
        done = anyio.Event()
        ranks = attempt.layout.local_world_size

        def check(*_shown: object) -> None:
            if self.progress.attempt == attempt.number and self.progress.count() >= ranks:
                done.set()

        self.progress.listeners.append(check)
        try:
            check()
            await done.wait()
        finally:
            self.progress.listeners.remove(check)

    def _plan(self, attempt: Attempt) -> StandbyPlan:
        """Which ranks get a standby for the next attempt (``core.warm.ranks_wanting``),
        planned at once (``StandbySet.plan``)."""
        prefix = interpreter(self.python)
        workers = {w.local_rank: w for w in attempt.workers}
        ranks = warm.ranks_wanting(
            ((w.local_rank, Standby.accepts(prefix, w.spec.argv)) for w in attempt.workers),
            self.standbys.held)
        wanted = []
        for rank in ranks:
            worker = workers[rank]
            env = standby_env(worker.spec.env)
            path0 = cold_path0(worker.spec.argv[len(prefix):], worker.spec.cwd, env)
            wanted.append(StandbyRequest(rank, env, worker.spec.cwd, worker.spec.cpus,
                                         attempt.directory / str(rank), worker.pid,
                                         worker.start.warm,
                                         frozenset(self.learner.excluded), path0))
        return self.standbys.plan(wanted)

    async def _start(self, plan: StandbyPlan) -> None:
        """Start the planned standbys (``StandbySet.start``): forked, those whose
        environment is the ready fork server's; started, the others
        (``core.warm.split_by_source``)."""
        server = self.forks.server if self.forks is not None else None
        forked, started = warm.split_by_source(
            [(w.rank, w.env) for w in plan.wanted], self.forking,
            None if server is None else server.config.env)
        by_rank = {w.rank: w for w in plan.wanted}
        await self.standbys.start(
            plan, None if self.forked is None else (self.forked, [by_rank[r] for r in forked]),
            (self.spawned, [by_rank[r] for r in started]))

    async def _standby_failed(self, standby: Standby, failure: str) -> None:
        """A standby's preload failed: its rank starts cold; one that an ``auto`` preload
        tainted is replaced by one without that package."""
        tainted = standby.tainted()
        if tainted is None:
            logger.warning("standby for local rank %d discarded, the rank will start cold: %s",
                           standby.local_rank, failure)
            self.cold.note(standby.local_rank, warm.PRELOAD_FAILED)
        else:
            logger.warning("--preload auto: %s; package %r is never preloaded in this run",
                           failure, tainted)
            self.learner.excluded.add(tainted)
        if self.standbys.drop(standby):
            await self._retry_tainted(standby.local_rank, tainted)

    async def _retry_tainted(self, rank: int, tainted: str | None) -> None:
        """A new standby for a rank whose auto preload was tainted (without that package)."""
        attempt = self._attempt
        if tainted is not None and attempt is not None and not attempt.stopping \
                and self.taints.allow(rank):
            await self._start(self._plan(attempt))  # without it now

    # ------------------------------------------------------------------ the hand-off
    async def ready(self, local_rank: int) -> None:
        """Before ``take``: give the rank's forked standby, if it is still setting itself
        up, a moment to report (``StandbySet.ready``); the loop runs meanwhile."""
        await self.standbys.ready(local_rank)

    def take(self, spec: WorkerSpec) -> Worker | None:
        """Start the worker in its rank's standby; None if there is none or it cannot."""
        standby = self.standbys.take(spec.local_rank)
        if standby is None:
            return None
        worker = None
        cold = warm.cold_reason(Standby.accepts(standby.prefix, spec.argv),
                                env_mismatch(standby.env, spec.env),
                                standby.preload_failure())
        if cold is None:
            per_attempt = {k: spec.env[k] for k in PER_ATTEMPT_ENV if k in spec.env}
            record = (str(Path(spec.env["TORCHELASTIC_ERROR_FILE"]).parent
                          / autopreload.RECORD_NAME)
                      if self.options.auto else None)
            # only a preloaded standby waits for rank 0's store: one that imports the
            # framework itself would serialise that import behind rank 0's
            store = self._await_store(spec) if standby.preloading else None
            worker = standby.go(spec, per_attempt, store, record)
        else:
            logger.warning("local rank %d starts cold: %s", spec.local_rank, cold[1])
        if worker is None:
            self.cold.current[spec.local_rank] = cold[0] if cold is not None else "other"
            self.standbys.discard(standby)
        return worker

    def cold_start(self, local_rank: int) -> Start:
        failing = self.forks is not None and self.preloading and self.forks.preload_failing
        return Start(cold_reason=self.cold.reason(local_rank, failing))

    def _await_store(self, spec: WorkerSpec) -> tuple[str, int, float] | None:
        """Where a preloaded warm rank waits for rank 0's store (``store.RankZeroStore``)."""
        attempt = self._attempt
        return None if attempt is None else self.store.wait_for(attempt.layout,
                                                                 spec.global_rank)

    def _learn_store(self, attempt: Attempt) -> None:
        """Learn whether rank 0 hosts a store here (only preloaded standbys use it)."""
        if self.preloading:
            self.store.learn(attempt.layout)

    # ------------------------------------------------------------------ the end
    def pids(self) -> set[int]:
        forks = self.forks.pids() if self.forks is not None else set()
        return self.standbys.pids() | forks

    def close(self) -> None:
        self.standbys.close()
        if self.forked is not None:
            self.forked.forked_from.clear()
        if self.forks is not None:
            # with packages found tainted since it was learned
            kept = self.learner.to_keep(self.forks.excluded)
            if kept is not None:
                autopreload.keep(*kept)
            self.forks.close()


def _running(attempt: Attempt) -> bool:
    """Whether the attempt still runs: not stopping, and not every worker exited (the
    group then waits at the exit barrier or stops: no next attempt to prepare for)."""
    return not attempt.stopping and any(w.status is None for w in attempt.workers)
