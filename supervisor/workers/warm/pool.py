"""The warm pool: which local ranks get a standby for the next attempt, and when.

``WarmPool`` decides and does everything about standbys: whether another attempt may
follow (so standbys are worth their memory), when to start them (right after a launch;
with ``--preload`` forked from the node's fork server, the first attempt's before its
launch; standbys that import for themselves once the ranks resumed; the ``auto``
settle), one at a time, hearing each one's report, replacing one an ``auto`` preload
tainted, and learning whether rank 0 hosts a store the warm ranks should wait for. The
worker group asks it for a rank's worker (``take``) and tells it when an attempt begins,
was launched and stops; ``base.NullPool`` is the pool of ``--no-warm-restart``, of runs
that can have no second attempt, and of tests of the group alone. The rules are in
docs/design.md ("Warm restarts").
"""

from __future__ import annotations

import errno
import logging
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread
from anyio.abc import TaskGroup

from supervisor.config import Settings
from supervisor.core.envs import PER_RANK_ENV, fork_mismatch, fork_server_env, interpreter
from supervisor.core.snapshot import ProgressTable
from supervisor.workers.guardian import Guardian
from supervisor.workers.spawn import SPAWNER, DeathSignal, Spawner, Start, Worker, WorkerSpec
from supervisor.workers.warm import autopreload
from supervisor.workers.warm.base import Preview, attempt_may_follow
from supervisor.workers.warm.forkserver import ForkServerConfig, Wanted, cold_path0
from supervisor.workers.warm.standby import (
    PER_ATTEMPT_ENV,
    SETUP_WAIT,
    Standby,
    StandbyOptions,
    discard_all,
    env_mismatch,
    spawn_standby,
    standby_env,
)

if TYPE_CHECKING:
    from supervisor.workers.group import Attempt
    from supervisor.workers.warm.forkslot import ForkSlot
    from supervisor.workers.warm.memory import MemorySample, MemorySampler

logger = logging.getLogger(__name__)

TAINT_RETRIES = 3  # new standbys per rank after auto preloads that read a per-attempt variable
STORE_WAIT = 5.0  # seconds a warm rank waits for rank 0's store before it dials anyway
STAGGER = 0.03  # s at most between two standbys' starts (see ``WarmPool._start``)
AUTO_SETTLE = 5.5  # s after a launch: a warm worker has recorded its imports at 1 and 5 s
# s a restart waits for a fork server still importing when this node has not yet seen what
# a cold start costs (no progress shown): a preload that hangs delays one restart by this
UNKNOWN_COLD_WAIT = 60.0
# s after a launch at the latest that standbys importing for themselves (no fork server:
# the embedded API, a rank whose environment differs) start, for a job that shows no
# progress (they start once every rank has shown some)
PRELOAD_AFTER = 5.0


@dataclass
class _Wanted:
    """One standby to start: its rank, environment, cwd, CPUs; what to learn from."""

    rank: int
    env: dict[str, str]
    cwd: str | None
    cpus: tuple[int, ...] | None
    rank_dir: Path
    pid: int  # the rank's current worker (its imports are what ``auto`` preloads)
    warm: bool
    exclude: frozenset[str]  # packages ``auto`` must leave out (read a per-attempt var)
    path0: str | None = None  # the cold command's sys.path[0] (``forkserver.cold_path0``)


@dataclass
class StandbyPlan:
    """Standbys about to be started, one at a time; ``done`` once no more will be.

    ``halt`` (a stop began) starts no further one and ends the pause between two."""

    wanted: list[_Wanted]
    done: anyio.Event
    started: bool = False
    halted: bool = False
    pause: anyio.CancelScope | None = None

    def halt(self) -> None:
        self.halted = True
        if self.pause is not None:
            self.pause.cancel()


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
        self.spawner = spawner  # forks every started standby (spawn.Spawner says why)
        # the node's fork server (--preload under the daemon): standbys are forked from it
        self.forks = forks
        self.sampler: MemorySampler | None = None
        if forks is not None:  # the fork server's modules: only for runs that use it
            from supervisor.workers.warm.memory import MemorySampler

            self.sampler = MemorySampler(self.memory_targets)
        self._forked: set[int] = set()  # local ranks whose standby was forked
        self._forked_from: dict[int, int] = {}  # local rank -> pid of the server it came from
        self._node_auto: list[str] | None = None  # --preload auto: learned for the node
        self._learned_first = False  # learned from this run's first attempt
        self._auto_refined = False  # learned again from a warm attempt's own record
        self.python = python
        self.death = death
        self.progress = progress
        self.membership_can_change = membership_can_change
        self.guardian = guardian
        self.standbys: dict[int, Standby] = {}  # local rank -> its warm interpreter
        self._reported: dict[int, anyio.Event] = {}  # local rank -> set once it reported
        explicit = tuple(m for m in settings.preload if m != "auto")
        self.options = StandbyOptions(preload=explicit, auto="auto" in settings.preload)
        self.auto_names: dict[int, list[str]] = {}  # local rank -> its last worker's imports
        self.auto_excluded: set[str] = set()  # packages that read a per-attempt variable
        # --preload auto under the fork server: the node's list an earlier run kept here
        self._run_dir = run_dir if self.options.auto and forks is not None else None
        self._kept: tuple[list[str], set[str]] = ([], set())
        if self._run_dir is not None:
            self._kept = autopreload.read_kept(self._run_dir)
            self._node_auto = list(self._kept[0]) or None
            self.auto_excluded |= self._kept[1]
        self._taint_retries: dict[int, int] = {}
        self._cold: dict[int, str] = {}  # local rank -> why its standby went unused
        self._pending_cold: dict[int, str] = {}  # the same, learned before the launch
        # standbys due from a fork server still being prepared
        self._preparing: StandbyPlan | None = None
        self._counted_early = False  # ``begin`` counted them as cold for a failed preload
        self._attempt: Attempt | None = None  # the one being started, then running
        self._due: StandbyPlan | None = None  # planned at the launch, started by ``run``
        # standbys being started (a retry after a tainted auto preload adds one meanwhile)
        self._plans: list[StandbyPlan] = []
        # whether rank 0's store listened on MASTER_PORT in an earlier attempt (learned)
        self.store_seen = False
        self._launched_at = 0.0  # monotonic time of the last launch
        # launch -> every rank's first progress of this node's last cold attempt
        self.cold_startup: float | None = None
        self._waited_for: int | None = None  # the importing server a restart waited for
        progress.listeners.append(self._on_progress)
        self._preview: Preview | None = None  # the first attempt's ranks (``warm_up``)
        self._previewed = anyio.Event()
        self._first_forked = anyio.Event()  # ``_stand_by_first`` forked or gave up

    @property
    def preloading(self) -> bool:
        """Whether standbys import modules before they wait (``--preload``)."""
        return bool(self.options.preload) or self.options.auto

    @property
    def forking(self) -> bool:
        """Whether standbys are forked from the node's fork server."""
        return self.forks is not None and self.preloading and not self.forks.given_up

    def restart_possible(self, restart_count: int) -> bool:
        """Whether another attempt may follow this one (``base.attempt_may_follow``)."""
        return attempt_may_follow(restart_count, self.settings.max_restarts,
                                  self.membership_can_change)

    # ------------------------------------------------------------------ the attempt
    def begin(self, attempt: Attempt) -> None:
        self._attempt = attempt
        if self._preparing is not None and self.forks is not None \
                and self.forks.preload_failing:
            # the last attempt ended while its standbys waited for a new server, the last
            # one's preload having failed: those ranks start cold for that reason (also
            # when the new server has not failed yet: it imports the same list)
            for want in self._preparing.wanted:
                self._pending_cold.setdefault(want.rank, "preload_failed")
            self._counted_early = True
        self._cold, self._pending_cold = self._pending_cold, {}

    def launched(self, attempt: Attempt) -> None:
        """Without preloading, plan the standbys now, before any event of this attempt is
        handled: a stop that begins before they are started waits for the spawn."""
        self._launched_at = time.monotonic()
        self._due = None
        if self.restart_possible(attempt.layout.restart_count) and (
                not self.preloading or self.forking):
            self._due = self._plan(attempt)

    async def run(self, attempt: Attempt) -> None:
        due, self._due = self._due, None
        if not self.restart_possible(attempt.layout.restart_count):
            return
        if due is not None and self.forking:
            await self._fork_standbys(attempt, due)
        elif due is not None:
            await self._start(due)
        else:
            await self._preload_when_resumed(attempt)

    # ------------------------------------------------------------------ forked standbys
    async def _prepare(self, config: ForkServerConfig, due: StandbyPlan) -> bool:
        """``forks.prepare``, with ``due`` known to ``begin`` meanwhile."""
        assert self.forks is not None
        self._preparing, self._counted_early = due, False
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
            self._drop(due)
            return
        if self.forks.usable_for(config):
            self.forks.request(config)  # a replacement, if the list changed: later
        elif not config.preload and not config.auto_names:
            self._drop(due)  # auto, nothing learned yet: no server to fork from
        elif not await self._prepare(config, due):
            self._drop(due)  # cold starts; a new server is tried at the next launch
            if not self._counted_early:  # as standbys whose preload failed, once
                for want in due.wanted:
                    self._pending_cold[want.rank] = "preload_failed"
            if self.forks.given_up:  # as without the fork server, from now on
                await self._preload_when_resumed(attempt)
            return
        if not due.halted:
            await self._start(due)
            if self._died_at_fork(due) and await self.forks.prepare(config) \
                    and self._attempt is attempt and _running(attempt):
                await self._start(self._plan(attempt))  # from its replacement, at once
        if self.options.auto and (not self._learned_first or self._refine_auto(attempt)):
            await self._learn_auto(attempt)

    def _died_at_fork(self, plan: StandbyPlan) -> bool:
        """Whether the server was found unusable when asked for ``plan``'s standbys (killed
        since its last fork, or not answering): a replacement is started then, not at
        the next launch, so that the next attempt does not start cold too."""
        assert self.forks is not None
        return (not plan.halted and self.forks.server is None and not self.forks.given_up
                and any(w.rank not in self.standbys for w in plan.wanted))

    def _refine_auto(self, attempt: Attempt) -> bool:
        """Whether to learn once more, from the first attempt whose ranks all ran warm:
        a cold worker's list is the shared libraries it mapped (``torch``), a warm one
        records the modules it imported, pure-Python ones too (DDP imports
        ``torch._dynamo`` at its first use: seconds that a preload saves)."""
        if self._auto_refined or not attempt.workers \
                or not all(w.start.warm for w in attempt.workers):
            return False
        self._auto_refined = True
        return True

    async def _learn_auto(self, attempt: Attempt) -> None:
        """``--preload auto`` learns for the node from the first attempt's workers (and
        once more from the first warm attempt's, ``_refine_auto``); a new server imports
        the list, then the standbys are forked again from it."""
        assert self.forks is not None
        launched = time.monotonic()
        await anyio.sleep(max(0.0, launched + AUTO_SETTLE - time.monotonic()))
        if not _running(attempt):
            return
        learned = await anyio.to_thread.run_sync(self._node_names, attempt)
        self._learned_first = True
        names = list(dict.fromkeys([*(self._node_auto or ()), *learned]))
        if not names or names == self._node_auto:
            self._node_auto = names
            return  # nothing new: the server there is the one to keep
        self._node_auto = names
        kept = self._to_keep()
        if kept is not None:
            await anyio.to_thread.run_sync(autopreload.keep, *kept)
        config = self._fork_config(attempt)
        if config is None or not await self.forks.prepare(config):
            return
        server = self.forks.server
        stale = [r for r in self._forked if server is None
                 or self._forked_from.get(r) != server.pid]
        for rank in stale:  # forked before the list was learned: fork them again
            standby = self.standbys.pop(rank, None)
            if standby is not None:
                self._discard(standby)
        if self._attempt is attempt and _running(attempt):
            await self._start(self._plan(attempt))

    def _to_keep(self) -> tuple[Path, list[str], set[str]] | None:
        """``autopreload.keep``'s arguments: the run directory, the node's auto list and the
        packages found tainted, for the next run; None when there is nothing new since the
        last call (which notes what it returns as kept)."""
        assert self.forks is not None
        kept = (list(self._node_auto or ()), self.auto_excluded | self.forks.excluded)
        if self._run_dir is None or kept == self._kept or not kept[0]:
            return None
        self._kept = kept
        return self._run_dir, *kept

    def _node_names(self, attempt: Attempt) -> list[str]:
        """What the first attempt's workers imported, in order, every rank's (a thread)."""
        found: dict[str, None] = {}
        for worker in attempt.workers:
            rank_dir = attempt.directory / str(worker.local_rank)
            names = autopreload.read_record(rank_dir) if worker.start.warm else []
            if not names and not worker.reaped:  # a reaped worker's pid may be another's now
                names = autopreload.cold_worker_modules(worker.pid)
            found.update(dict.fromkeys(names))
        logger.debug("--preload auto learned %d module(s) for the node: %s", len(found),
                     ",".join(list(found)[:8]) + ("..." if len(found) > 8 else ""))
        return list(found)

    def warm_up(self, preview: Preview | None) -> None:
        """At the supervisor's start (while the rendezvous forms): have the fork server
        import the explicit ``--preload`` list (and the ``auto`` list an earlier run kept)
        for the command the first attempt will run; the first attempt starts in
        interpreters forked from it (``settle``). With ``auto`` and nothing kept, a server
        with nothing preloaded: the first attempt's forked workers then record every
        module they import (a cold one shows only its shared libraries), so the first
        restart gets them all."""
        if preview is None or not self.forking:
            return
        config = self._config_for(preview.argv, None, preview.envs)
        if config is not None and self.forks is not None:
            self.forks.request(config)
            self._preview = preview
            self._previewed.set()

    def _on_progress(self, attempt: int, _local_rank: int, now: float) -> None:
        """Learn how long a cold start takes on this node (``settle`` weighs it)."""
        current = self._attempt
        if current is None or current.number != attempt or not current.workers \
                or any(w.start.warm for w in current.workers) \
                or self.progress.count() < len(current.workers):
            return
        self.cold_startup = now - self._launched_at

    async def settle(self) -> None:
        """Before a restart's launch, for ranks that have no standby: fork them from the
        ready server (it got ready after the stop halted their forks), or wait for the
        server still importing, when that is sooner than a cold start.

        Sooner: the server began importing before the attempt that just stopped, so it is
        ahead of a cold worker that would import the same modules from nothing; it is
        waited for at most as long as this node's last cold start took from launch to
        every rank's first progress (not seen yet: what the last ready server's import
        took; neither known: ``UNKNOWN_COLD_WAIT``), and then the
        ranks start cold, the import going on for the next restart. One server is waited
        for once: a preload that hangs delays one restart, not every one. Before the first
        launch: ``_settle_first``."""
        attempt = self._attempt
        if attempt is None:
            await self._settle_first()
            return
        if self.forks is None or not self.forking or not attempt.workers \
                or all(w.local_rank in self.standbys for w in attempt.workers):
            return
        config = self._fork_config(attempt)
        if config is None:
            return
        if not self.forks.usable_for(config):
            importing = self.forks.importing_for(config)
            pending = self.forks.pending_pid()
            if importing is None or pending == self._waited_for:
                return  # no server on its way (or it already kept a restart waiting)
            self._waited_for = pending
            # a cold start's cost here: seen, else what the last server's import took
            limit = self.cold_startup or self.forks.import_seconds
            logger.info("waiting for the fork server (importing for %.1f s) rather than "
                        "starting cold%s", importing,
                        "" if limit is None else f" (at most {limit:.1f} s, a cold start)")
            ready = False
            with anyio.move_on_after(UNKNOWN_COLD_WAIT if limit is None else limit):
                ready = await self.forks.prepare(config)
            if not ready:
                logger.info("the fork server is not ready: the ranks start cold")
                return
        await self._start(self._plan(attempt))

    async def _settle_first(self) -> None:
        """Before the first launch, with ``--preload`` under the daemon: wait for the fork
        server ``warm_up`` started (its import: one per node instead of one per rank)
        and for the standbys ``_stand_by_first`` forks from it, in which the first
        attempt's ranks start. A preload that fails means cold starts (the slot warned
        and counted it); a rank whose environment is not the node's starts cold."""
        if not self._previewed.is_set() or self._first_forked.is_set():
            return
        assert self.forks is not None
        config = self._first_config()
        importing = None if config is None else self.forks.importing_for(config)
        logger.info("the first attempt waits for the fork server's import%s",
                    "" if importing is None else f" (importing for {importing:.1f} s)")
        await self._first_forked.wait()

    async def _stand_by_first(self) -> None:
        """Fork a standby per rank as soon as the fork server that ``warm_up`` asked for is
        ready, if no attempt has begun yet: the first attempt (a spare's, when it is
        admitted) starts in them (``_settle_first``)."""
        try:
            await self._previewed.wait()
            await self._fork_first()
        finally:
            self._first_forked.set()

    def _first_config(self) -> ForkServerConfig | None:
        """The fork server for the first attempt's command (``warm_up``'s preview)."""
        preview = self._preview
        return None if preview is None else self._config_for(preview.argv, None,
                                                             preview.envs)

    async def _fork_first(self) -> None:
        preview = self._preview
        config = self._first_config()
        if preview is None or config is None or self.forks is None \
                or not await self.forks.prepare(config) or self._attempt is not None:
            return
        wanted = [
            _Wanted(rank, standby_env(env), None, cpus, Path(), 0, False,
                    frozenset(self.auto_excluded), config.path0)
            for rank, (env, cpus) in enumerate(zip(preview.envs, preview.cpus, strict=True))
            if rank not in self.standbys
        ]
        plan = StandbyPlan(wanted, anyio.Event())
        if wanted:
            self._plans.append(plan)
            logger.debug("forking %d standby(s) for the first attempt while the "
                         "rendezvous forms", len(wanted))
            await self._start(plan)

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
            preload=self.options.preload, auto_names=tuple(self._node_auto or ()),
            exclude=frozenset(self.auto_excluded), watch=(*PER_ATTEMPT_ENV, *PER_RANK_ENV),
        )

    def _fork(self, wanted: list[_Wanted]) -> list[Standby | None]:
        """Standbys forked for ``wanted`` in one request (in a worker thread), in its
        order; None: that rank starts cold."""
        assert self.forks is not None
        for want in wanted:
            self._forked.discard(want.rank)
        server = self.forks.server
        forked = self.forks.fork([Wanted(w.rank, w.env, w.cpus) for w in wanted])
        if server is None or forked is None:
            return [None] * len(wanted)
        standbys: list[Standby | None] = []
        config = server.config
        for want, one in zip(wanted, forked, strict=True):
            if one is None:
                standbys.append(None)
                continue
            logger.debug("standby for local rank %d forked as pid %d by the fork server "
                         "(pid %d)", want.rank, one.process.pid, server.pid)
            self._forked.add(want.rank)
            self._forked_from[want.rank] = server.pid
            standbys.append(Standby(one.process, one.sock, interpreter(self.python),
                                    want.env, (*config.preload, *config.auto_names),
                                    forked=True))
        return standbys

    def _split(self, wanted: list[_Wanted]) -> tuple[list[_Wanted], list[_Wanted]]:
        """Those of ``wanted`` the ready fork server forks, and those that get a started
        standby: a rank whose environment is not the node's, or every rank without the
        fork server. While forking, none starts without a ready server (cold starts)."""
        if not self.forking:
            return [], wanted
        assert self.forks is not None
        server = self.forks.server
        if server is None:
            return [], []
        forked = [w for w in wanted if fork_mismatch(server.config.env, w.env) is None]
        return forked, [w for w in wanted if w not in forked]

    async def start_tasks(self, tg: TaskGroup) -> None:
        """The run-long tasks of the fork server: its slot, the memory sampler."""
        if self.forks is not None:
            await tg.start(self.forks.run)
            tg.start_soon(self._stand_by_first)
        if self.sampler is not None:
            tg.start_soon(self.sampler.run)

    def memory(self) -> MemorySample | None:
        return self.sampler.last if self.sampler is not None else None

    def memory_targets(self) -> tuple[int | None, dict[int, int]]:
        """What the sampler reads: the ready fork server, the forked standbys."""
        server = self.forks.server if self.forks is not None else None
        return (server.pid if server is not None else None,
                {r: s.pid for r, s in self.standbys.items() if r in self._forked})

    def fork_failures(self) -> dict[str, int]:
        return dict(self.forks.failures) if self.forks is not None else {}

    def _drop(self, plan: StandbyPlan) -> None:
        """A plan that will start nothing."""
        plan.done.set()
        if plan in self._plans:
            self._plans.remove(plan)

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

    # ------------------------------------------------------------------ starting standbys
    def _plan(self, attempt: Attempt) -> StandbyPlan:
        """Which ranks get a standby for the next attempt (those whose command can run
        warm and that have none). Marks the spawn as under way at once: a stop that
        begins before ``_start`` is done waits for it before it sweeps, or it would take
        a new standby for debris."""
        wanted = []
        for worker in attempt.workers:
            rank = worker.local_rank
            if rank in self.standbys or not Standby.accepts(interpreter(self.python),
                                                             worker.spec.argv):
                continue
            env = standby_env(worker.spec.env)
            path0 = cold_path0(worker.spec.argv[len(interpreter(self.python)):],
                               worker.spec.cwd, env)
            wanted.append(_Wanted(rank, env, worker.spec.cwd,
                                  worker.spec.cpus, attempt.directory / str(rank),
                                  worker.pid, worker.start.warm,
                                  frozenset(self.auto_excluded), path0))
        plan = StandbyPlan(wanted, anyio.Event())
        if wanted:
            self._plans.append(plan)
        else:
            plan.done.set()
        return plan

    async def _start(self, plan: StandbyPlan) -> None:
        """Start the planned standbys: those the fork server can fork in one request
        (they set themselves up one after another: ``forkserver_main._fork_each``), the
        others one at a time, each once the one before it has reported (started, and done
        preloading) or ``STAGGER`` s after it started.

        Each spawn runs on the spawner thread (the loop stays responsive). One at a time
        because a new process, or thread, is not yet behind the workers in the kernel's
        queue (EEVDF places it as eligible, however low its priority): eight started at
        once on two CPUs took the CPU from our loop for tens of milliseconds per restart
        (``/healthz`` p99 2 to 5 times higher during restarts), one at a time they
        do not. A stop halts the plan and waits only for the spawn in flight."""
        if not plan.wanted:
            return
        plan.started = True
        async with anyio.create_task_group() as tg:
            try:
                forkable, others = self._split(plan.wanted)
                if forkable:
                    for standby in await self.spawner.spawn(self._fork, forkable):
                        if standby is not None:
                            self._register(standby, tg)
                for want in others:
                    if plan.halted:
                        break
                    started = await self.spawner.spawn(self._spawn_started, want)
                    if started is None:
                        break
                    reported = self._register(started, tg)
                    with anyio.move_on_after(STAGGER) as plan.pause:
                        if not plan.halted and reported is not None:
                            await reported.wait()
                    plan.pause = None
            finally:
                plan.done.set()
                if plan in self._plans:
                    self._plans.remove(plan)

    def _register(self, standby: Standby, tg: TaskGroup) -> anyio.Event | None:
        """Keep a new standby for its rank and watch for its report (the event is set when
        it comes); None: another plan's standby for the rank came first, this one goes."""
        if standby.local_rank in self.standbys:
            self._discard(standby)
            return None
        self.standbys[standby.local_rank] = standby
        if self.guardian is not None:
            self.guardian.watch(standby.pid)
        logger.debug("standby for local rank %d started as pid %d",
                     standby.local_rank, standby.pid)
        reported = self._reported[standby.local_rank] = anyio.Event()
        tg.start_soon(self._watch_report, standby, reported)
        return reported

    async def _watch_report(self, standby: Standby, reported: anyio.Event) -> None:
        """Hear the standby's report the moment it comes: started (and preloaded), or
        failed; drop a failed one now."""
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
        if failure is None:
            what = [*standby.preload, *(["auto"] if standby.auto_spec else [])]
            logger.info("standby for local rank %d preloaded %s in %.2f s",
                        standby.local_rank, ",".join(what), time.monotonic() - began)
            if standby.skipped:
                logger.debug("standby for local rank %d could not preload: %s",
                             standby.local_rank, standby.skipped)
            return
        tainted = standby.tainted()
        if tainted is None:
            logger.warning("standby for local rank %d discarded, the rank will start cold: %s",
                           standby.local_rank, failure)
            self._pending_cold[standby.local_rank] = "preload_failed"
        else:
            logger.warning("--preload auto: %s; package %r is never preloaded in this run",
                           failure, tainted)
            self.auto_excluded.add(tainted)
        if self.standbys.get(standby.local_rank) is standby:
            del self.standbys[standby.local_rank]
            self._discard(standby)
            await self._retry_tainted(standby.local_rank, tainted)

    async def _retry_tainted(self, rank: int, tainted: str | None) -> None:
        """A new standby for a rank whose auto preload was tainted (without that package)."""
        attempt = self._attempt
        retries = self._taint_retries.get(rank, 0)
        if tainted is not None and attempt is not None and not attempt.stopping \
                and retries < TAINT_RETRIES:
            self._taint_retries[rank] = retries + 1
            await self._start(self._plan(attempt))  # without it now

    def _spawn_started(self, want: _Wanted) -> Standby | None:
        """Start one standby as a process of its own (its own preload)."""
        spec = self._auto_spec(want) if self.options.auto else None
        try:
            return spawn_standby(
                want.rank, self.python, want.env, self.death, cwd=want.cwd,
                cpus=want.cpus, options=self.options, auto_spec=spec, path0=want.path0,
            )
        except OSError as exc:
            autopreload.remove_spec(spec)
            logger.warning("cannot start a standby for local rank %d: %s", want.rank, exc)
            return None

    def _auto_spec(self, want: _Wanted) -> str | None:
        """The ``auto`` list of a rank's next standby (in a worker thread: reads files)."""
        names = autopreload.read_record(want.rank_dir) if want.warm else []
        source = "its record"
        if not names:
            names, source = autopreload.cold_worker_modules(want.pid), "its mapped libraries"
        if names:
            self.auto_names[want.rank] = names
            logger.debug("local rank %d: --preload auto learned %d module(s) from %s of "
                         "pid %d: %s", want.rank, len(names), source, want.pid,
                         ",".join(names[:8]) + ("..." if len(names) > 8 else ""))
        names = self.auto_names.get(want.rank, [])
        if not names:
            return None
        try:
            return autopreload.write_spec(names, set(want.exclude))
        except OSError as exc:
            logger.warning("cannot write the preload list of local rank %d: %s", want.rank, exc)
            return None

    async def halt(self, attempt: Attempt | None = None) -> None:
        plans = list(self._plans)
        for plan in plans:
            plan.halt()
        for plan in plans:
            if plan.started:
                await plan.done.wait()
            elif plan in self._plans:  # halted before it began: it will start nothing
                self._plans.remove(plan)
        if attempt is not None and attempt.workers:
            self._learn_store(attempt)

    # ------------------------------------------------------------------ the hand-off
    async def ready(self, local_rank: int) -> None:
        """Before ``take``: give the rank's forked standby, if it is still setting itself
        up (milliseconds, one after another in its batch), at most ``SETUP_WAIT`` s to
        report; the loop runs meanwhile."""
        standby = self.standbys.get(local_rank)
        reported = self._reported.get(local_rank)
        if standby is None or not standby.forked or reported is None:
            return
        with anyio.move_on_after(SETUP_WAIT):
            await reported.wait()

    def take(self, spec: WorkerSpec) -> Worker | None:
        """Start the worker in its rank's standby; None if there is none or it cannot."""
        self._reported.pop(spec.local_rank, None)
        standby = self.standbys.pop(spec.local_rank, None)
        if standby is None:
            return None
        worker = None
        cold = self._cold_reason(standby, spec)  # (metric label, log text) or None
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
            self._cold[spec.local_rank] = cold[0] if cold is not None else "other"
            self._discard(standby)
        return worker

    def cold_start(self, local_rank: int) -> Start:
        reason = self._cold.get(local_rank)
        if reason is None and self.forks is not None \
                and self.preloading and self.forks.preload_failing:
            # no standby because the node's fork server's last preload failed (however the
            # restart and the server's retry raced): that is why this rank starts cold
            reason = "preload_failed"
        return Start(cold_reason=reason)

    def _await_store(self, spec: WorkerSpec) -> tuple[str, int, float] | None:
        """For a preloaded warm rank other than 0 on rank 0's node, once the job is known
        to use rank 0's store: where to wait for it before the user's code dials it.

        torch's store client that dials before the server listens is refused and retries
        after an exponential backoff (250-750 ms first), which is most of a warm
        restart's ``init_process_group``; rank 0 is handed over first, and the others
        start their ``init_process_group`` only once its store accepts connections (a
        store of its own per attempt, as before: nothing is reused)."""
        attempt = self._attempt
        if not self.store_seen or attempt is None or attempt.layout.rank_offset != 0:
            return None
        if spec.global_rank == 0:
            return None
        return attempt.layout.master_addr, attempt.layout.master_port, STORE_WAIT

    def _learn_store(self, attempt: Attempt) -> None:
        """Note whether rank 0 (if it runs here) has its store listening on MASTER_PORT
        (only preloaded standbys use it)."""
        if self.preloading and not self.store_seen and attempt.layout.rank_offset == 0:
            self.store_seen = port_listening(attempt.layout.master_port)
            if self.store_seen:
                logger.debug("rank 0 hosts a store on port %d: warm ranks will wait for it",
                             attempt.layout.master_port)

    def _cold_reason(self, standby: Standby, spec: WorkerSpec) -> tuple[str, str] | None:
        """Why the standby cannot take this worker, as (metric label, log text), or None."""
        if not Standby.accepts(standby.prefix, spec.argv):
            return "other", "its command cannot run in a standby"
        changed = env_mismatch(standby.env, spec.env)
        if changed is not None:
            return ("env_changed",
                    f"environment variable {changed} changed since its standby started")
        failure = standby.preload_failure()
        if failure is not None:
            return "preload_failed", failure
        return None

    # ------------------------------------------------------------------ the end
    def _discard(self, standby: Standby) -> None:
        standby.discard()
        if self.guardian is not None:
            self.guardian.forget(standby.pid)

    def pids(self) -> set[int]:
        forks = self.forks.pids() if self.forks is not None else set()
        return {s.pid for s in self.standbys.values()} | forks

    def close(self) -> None:
        for pid in discard_all(self.standbys):
            if self.guardian is not None:
                self.guardian.forget(pid)
        self._forked.clear()
        if self.forks is not None:
            kept = self._to_keep()  # with packages found tainted since it was learned
            if kept is not None:
                autopreload.keep(*kept)
            self.forks.close()


def _running(attempt: Attempt) -> bool:
    """Whether the attempt still runs: not stopping, and not every worker exited (the
    group then waits at the exit barrier or stops: no next attempt to prepare for)."""
    return not attempt.stopping and any(w.status is None for w in attempt.workers)


def port_listening(port: int) -> bool:
    """Whether something of this host holds ``port`` (rank 0's store listening on it).

    A bind test, not a read of ``/proc/net/tcp``: that table holds every connection of the
    host (thousands under a busy health endpoint) and took milliseconds of the loop at
    every stop. Binding the wildcard address (with ``SO_REUSEADDR``, so connections in
    TIME_WAIT do not count) fails while any socket listens on the port."""
    for family, address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 here
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((address, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
        finally:
            probe.close()
    return False
