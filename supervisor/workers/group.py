"""The worker group: one attempt's processes, from launch to the last reap.

``WorkerGroup`` owns everything that touches an attempt's processes: the attempt's
directory, each rank's environment and output, the cold spawn or the hand-off to the rank's
standby, a monitor per worker that reports its exit, the standbys for the next attempt,
and the stop (TERM, grace, KILL, sweep, reap). It reports what happens as events into the
controller's inbox (``post``) and never calls back into the controller, which stays what
its docstring says: inbox -> pure state machine -> decisions carried out.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from supervisor.config import Settings
from supervisor.core import state as sm
from supervisor.core.envs import GroupLayout, interpreter, worker_argv, worker_env
from supervisor.events import EventLog
from supervisor.rendezvous.base import RendezvousResult
from supervisor.workers import autopreload
from supervisor.workers.attemptdir import create_attempt_dir
from supervisor.workers.errorfile import read_error_file
from supervisor.workers.guardian import Guardian
from supervisor.workers.output import OutputPlan
from supervisor.workers.spawn import (
    SPAWNER,
    DeathSignal,
    Spawner,
    Worker,
    WorkerSpec,
    spawn_worker,
    wait_exit,
)
from supervisor.workers.standby import (
    PER_ATTEMPT_ENV,
    Standby,
    StandbyOptions,
    discard_all,
    env_mismatch,
    spawn_standby,
    standby_env,
)
from supervisor.workers.stop import stop_group

logger = logging.getLogger(__name__)

# (local_rank, global_rank, rank_dir) -> argv of that rank's worker
CommandFor = Callable[[int, int, Path], list[str]]
# local_rank -> CPUs to bind the worker to, or None
CpusFor = Callable[[int], tuple[int, ...] | None]
Post = Callable[[sm.Event], None]
TAINT_RETRIES = 3  # new standbys per rank after auto preloads that read a per-attempt variable
STORE_WAIT = 5.0  # seconds a warm rank waits for rank 0's store before it dials anyway
STAGGER = 0.03  # s at most between two standbys' starts (see ``start_standbys``)


class AttemptPrepError(OSError):
    """The supervisor could not prepare an attempt (its own failure, not the workers')."""


@dataclass(eq=False)
class Attempt:
    """One incarnation of the worker group."""

    number: int
    dir_index: int
    directory: Path
    round: RendezvousResult
    layout: GroupLayout
    workers: list[Worker] = field(default_factory=list)
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    kill_now: anyio.Event = field(default_factory=anyio.Event)
    stopping: bool = False  # set when its stop begins: no new standbys from then on

    def error_file(self, local_rank: int) -> Path:
        return self.directory / str(local_rank) / "error.json"


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


class WorkerGroup:
    """Launches, watches and stops the attempts of one supervisor's local worker group."""

    def __init__(
        self,
        settings: Settings,
        *,
        run_id: str,
        events: EventLog,
        log_root: Path,
        output: OutputPlan,
        environ: Mapping[str, str],
        timer_file: str | None,
        post: Post,
        guardian: Guardian | None = None,
        sweep_adopted: bool = True,
        exempt_pids: Iterable[int] = (),
        command: CommandFor | None = None,
        cpus: CpusFor | None = None,
        spawner: Spawner = SPAWNER,
    ) -> None:
        self.settings = settings
        self.spawner = spawner  # forks every worker and standby (spawn.Spawner says why)
        self.run_id = run_id
        self.events = events
        self.log_root = log_root
        self.output = output
        self.environ = dict(environ)
        self.timer_file = timer_file
        self.post = post
        self.guardian = guardian
        self.sweep_adopted = sweep_adopted
        self.exempt_pids = set(exempt_pids)
        self.command = command or settings_command(settings, self.environ)
        self.cpus = cpus or (lambda local_rank: None)
        self.death = DeathSignal()
        self.attempt: Attempt | None = None
        self.standbys: dict[int, Standby] = {}  # local rank -> its warm interpreter
        explicit = tuple(m for m in settings.preload if m != "auto")
        self.standby_options = StandbyOptions(preload=explicit, auto="auto" in settings.preload)
        self.auto_names: dict[int, list[str]] = {}  # local rank -> its last worker's imports
        self.auto_excluded: set[str] = set()  # packages that read a per-attempt variable
        self._taint_retries: dict[int, int] = {}
        self._cold: dict[int, str] = {}  # local rank -> why its standby went unused
        self._pending_cold: dict[int, str] = {}  # the same, learned before the launch
        self._python = self.environ.get("PYTHON_EXEC", sys.executable)
        self.dir_base = _next_attempt_index(log_root / run_id)
        # standbys being started (a retry after a tainted auto preload adds one meanwhile)
        self._plans: list[StandbyPlan] = []
        # whether rank 0's store listened on MASTER_PORT in an earlier attempt (learned)
        self.store_seen = False

    # ------------------------------------------------------------------ launch
    def launch(
        self, number: int, restart_count: int, rnd: RendezvousResult
    ) -> tuple[Attempt, list[tuple[int, str]]]:
        """Start every local rank of attempt ``number``; returns it and ranks that failed."""
        dir_index = self.dir_base + number - 1
        layout = GroupLayout(
            run_id=self.run_id,
            role=self.settings.role,
            local_world_size=self.settings.local_world_size,
            group_rank=rnd.group_rank,
            group_world_size=rnd.group_world_size,
            rank_offset=rnd.rank_offset,
            world_size=rnd.world_size,
            master_addr=rnd.master_addr,
            master_port=rnd.master_port,
            restart_count=restart_count,
            max_restarts=self.settings.max_restarts,
            virtual_local_rank=self.settings.virtual_local_rank,
        )
        run_dir = self.log_root / self.run_id
        try:  # exclusively: a worker cannot plant files for its successor
            created = create_attempt_dir(run_dir, dir_index, layout.local_world_size,
                                         root=self.log_root)
        except OSError as exc:
            raise AttemptPrepError(f"cannot prepare {run_dir / f'attempt_{dir_index}'}: "
                                   f"{exc}") from exc
        self.dir_base += created.index - dir_index  # a taken index was skipped
        attempt = Attempt(number, created.index, created.path, rnd, layout)
        specs = self._prepare(attempt)  # raises AttemptPrepError: nothing was started
        self.attempt = attempt
        self._cold, self._pending_cold = self._pending_cold, {}
        failed_to_start: list[tuple[int, str]] = []
        for spec in specs:
            try:
                worker = self._start(spec)
                if spec.local_rank in self._cold:  # had a standby that could not take it
                    worker.extra["cold_reason"] = self._cold[spec.local_rank]
                attempt.workers.append(worker)
            except OSError as exc:
                logger.error("cannot start local rank %d: %s", spec.local_rank, exc)
                failed_to_start.append((spec.local_rank, str(exc)))
        return attempt, failed_to_start

    def _rank_env(self, attempt: Attempt, local_rank: int) -> dict[str, str]:
        return worker_env(
            self.environ, attempt.layout, local_rank,
            error_file=str(attempt.error_file(local_rank)), timer_file=self.timer_file,
        )

    def _prepare(self, attempt: Attempt) -> list[WorkerSpec]:
        """Directories, environment and output of every rank, before any is started.

        A failure here (full disk, no inodes, a directory that cannot be made) is the
        supervisor's, not the workers': it raises ``AttemptPrepError`` with nothing left
        behind, and the caller retries without touching the restart budget."""
        specs: list[WorkerSpec] = []
        try:
            for local_rank in range(attempt.layout.local_world_size):
                rank_dir = attempt.directory / str(local_rank)  # made with the attempt's
                env = self._rank_env(attempt, local_rank)
                global_rank = attempt.layout.rank_offset + local_rank
                argv = self.command(local_rank, global_rank, rank_dir)
                stdout, stderr = self.output.open_rank(
                    attempt.dir_index, rank_dir, local_rank, global_rank,
                    restart_count=attempt.layout.restart_count, root=self.log_root,
                )
                specs.append(WorkerSpec(local_rank, global_rank, argv, env, stdout, stderr,
                                        cpus=self.cpus(local_rank)))
        except OSError as exc:
            for spec in specs:
                self.output.after_spawn(spec.local_rank)  # their pipes reach EOF
            raise AttemptPrepError(f"cannot prepare {attempt.directory}: {exc}") from exc
        return specs

    def _start(self, spec: WorkerSpec) -> Worker:
        try:
            worker = self._warm_start(spec)
            if worker is None:
                worker = self.spawner.call(spawn_worker, spec, self.death)
                if self.guardian is not None:
                    self.guardian.watch(worker.pid)
        finally:
            self.output.after_spawn(spec.local_rank)
        logger.debug("local rank %d started as pid %d", spec.local_rank, worker.pid)
        return worker

    # ------------------------------------------------------------------ warm restarts
    def restart_possible(self, restart_count: int) -> bool:
        """Whether another attempt may follow this one (so standbys are worth their memory):
        failure restarts left, or a backend whose membership can change."""
        if self.settings.no_warm_restart:
            return False
        return self.settings.rdzv_backend != "static" or restart_count < self.settings.max_restarts

    @property
    def preloading(self) -> bool:
        """Whether standbys import modules before they wait (``--preload``)."""
        return bool(self.standby_options.preload) or self.standby_options.auto

    def plan_standbys(self, attempt: Attempt) -> StandbyPlan:
        """Which ranks get a standby for the next attempt (those whose command can run
        warm and that have none). Marks the spawn as under way at once: a stop that
        begins before ``start_standbys`` is done waits for it before it sweeps, or it
        would take a new standby for debris."""
        wanted = []
        for worker in attempt.workers:
            rank = worker.local_rank
            if rank in self.standbys or not Standby.accepts(interpreter(self._python),
                                                             worker.spec.argv):
                continue
            env = standby_env(self._rank_env(attempt, rank))
            wanted.append(_Wanted(rank, env, worker.spec.cwd, worker.spec.cpus,
                                  attempt.directory / str(rank), worker.pid,
                                  bool(worker.extra.get("warm")),
                                  frozenset(self.auto_excluded)))
        plan = StandbyPlan(wanted, anyio.Event())
        if wanted:
            self._plans.append(plan)
        else:
            plan.done.set()
        return plan

    async def start_standbys(self, plan: StandbyPlan) -> None:
        """Start the planned standbys one at a time: each once the one before it has
        reported (started, and done preloading) or ``STAGGER`` s after it started.

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
                for want in plan.wanted:
                    if plan.halted:
                        break
                    standby = await self.spawner.spawn(self._spawn_standby, want)
                    if standby is None:
                        break
                    self.standbys[standby.local_rank] = standby
                    if self.guardian is not None:
                        self.guardian.watch(standby.pid)
                    logger.debug("standby for local rank %d started as pid %d",
                                 standby.local_rank, standby.pid)
                    reported = anyio.Event()
                    tg.start_soon(self._watch_report, standby, reported)
                    with anyio.move_on_after(STAGGER) as plan.pause:
                        if not plan.halted:
                            await reported.wait()
                    plan.pause = None
            finally:
                plan.done.set()
                if plan in self._plans:
                    self._plans.remove(plan)

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
            standby.discard()
            if self.guardian is not None:
                self.guardian.forget(standby.pid)
            attempt = self.attempt
            retries = self._taint_retries.get(standby.local_rank, 0)
            if tainted is not None and attempt is not None and not attempt.stopping \
                    and retries < TAINT_RETRIES:
                self._taint_retries[standby.local_rank] = retries + 1
                await self.start_standbys(self.plan_standbys(attempt))  # without it now

    def _spawn_standby(self, want: _Wanted) -> Standby | None:
        """Start one standby (in a worker thread); None if it cannot be started."""
        spec = self._auto_spec(want) if self.standby_options.auto else None
        try:
            return spawn_standby(
                want.rank, self._python, want.env, self.death, cwd=want.cwd,
                cpus=want.cpus, options=self.standby_options, auto_spec=spec,
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
            names, source = autopreload.mapped_packages(want.pid), "its mapped libraries"
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

    async def _standbys_in(self) -> None:
        """Start no further standby; wait for the spawn in flight."""
        plans = list(self._plans)
        for plan in plans:
            plan.halt()
        for plan in plans:
            if plan.started:
                await plan.done.wait()
            elif plan in self._plans:  # halted before it began: it will start nothing
                self._plans.remove(plan)

    def _warm_start(self, spec: WorkerSpec) -> Worker | None:
        """Start the worker in its rank's standby; None if there is none or it cannot."""
        standby = self.standbys.pop(spec.local_rank, None)
        if standby is None:
            return None
        worker = None
        cold = self._cold_reason(standby, spec)  # (metric label, log text) or None
        if cold is None:
            per_attempt = {k: spec.env[k] for k in PER_ATTEMPT_ENV if k in spec.env}
            record = (str(Path(spec.env["TORCHELASTIC_ERROR_FILE"]).parent
                          / autopreload.RECORD_NAME)
                      if self.standby_options.auto else None)
            # only a preloaded standby waits for rank 0's store: one that imports the
            # framework itself would serialise that import behind rank 0's
            store = self._await_store(spec) if standby.preloading else None
            worker = standby.go(spec, per_attempt, store, record)
        else:
            logger.warning("local rank %d starts cold: %s", spec.local_rank, cold[1])
        if worker is None:
            self._cold[spec.local_rank] = cold[0] if cold is not None else "other"
            standby.discard()
            if self.guardian is not None:
                self.guardian.forget(standby.pid)
            return None
        worker.extra["warm"] = True
        return worker

    def _await_store(self, spec: WorkerSpec) -> tuple[str, int, float] | None:
        """For a preloaded warm rank other than 0 on rank 0's node, once the job is known
        to use rank 0's store: where to wait for it before the user's code dials it.

        torch's store client that dials before the server listens is refused and retries
        after an exponential backoff (250-750 ms first), which is most of a warm
        restart's ``init_process_group``; rank 0 is handed over first, and the others
        start their ``init_process_group`` only once its store accepts connections (a
        store of its own per attempt, as before: nothing is reused)."""
        attempt = self.attempt
        if not self.store_seen or attempt is None or attempt.layout.rank_offset != 0:
            return None
        if spec.global_rank == 0:
            return None
        return attempt.layout.master_addr, attempt.layout.master_port, STORE_WAIT

    def learn_store(self, attempt: Attempt) -> None:
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

    def discard_standbys(self) -> None:
        for pid in discard_all(self.standbys):
            if self.guardian is not None:
                self.guardian.forget(pid)

    def exempt(self) -> set[int]:
        """Our children a group's sweep must not kill: the guardian and the standbys."""
        return self.exempt_pids | {s.pid for s in self.standbys.values()}

    # ------------------------------------------------------------------ monitors
    async def supervise(
        self, attempt: Attempt, *also: Callable[[Attempt], Coroutine[Any, Any, None]]
    ) -> None:
        """The attempt's worker monitors (and ``also`` tasks); cancelled when it stops."""
        with attempt.scope:
            async with anyio.create_task_group() as tg:
                for worker in attempt.workers:
                    tg.start_soon(self._monitor, attempt, worker)
                for task in also:
                    tg.start_soon(task, attempt)

    async def _monitor(self, attempt: Attempt, worker: Worker) -> None:
        status = await wait_exit(worker)
        worker.exited.set()
        message = ""
        if not status.ok:
            report = read_error_file(attempt.error_file(worker.local_rank))
            message = report.summary if report else ""
            if report and report.traceback:
                worker.extra["traceback"] = report.traceback
        self.events.emit(
            "worker_exited", local_rank=worker.local_rank, rank=worker.spec.global_rank,
            pid=worker.pid, exit_code=status.exit_code,
            signal=sm.signal_name(status.signal) if status.signal else None,
            message=message or None,
        )
        self.post(
            sm.WorkerExited(
                attempt.number, worker.local_rank, worker.pid, status.exit_code,
                status.signal, status.at, message,
            )
        )

    # ------------------------------------------------------------------ stop
    async def stop(self, attempt: Attempt | None, signum: int) -> None:
        """Stop the attempt's workers: ``signum``, the grace, SIGKILL, sweep, reap."""
        if attempt is not None:
            attempt.stopping = True
        await self._standbys_in()
        if attempt is None or not attempt.workers:
            return
        self.learn_store(attempt)
        await stop_group(
            attempt.workers,
            signum=signum,
            grace=self.settings.shutdown_timeout,
            kill_now=attempt.kill_now,
            sweep_adopted=self.sweep_adopted,
            exempt=self.exempt(),
        )
        attempt.scope.cancel()
        self._forget_reaped(attempt)
        await self.output.drain(attempt.dir_index)

    def _forget_reaped(self, attempt: Attempt) -> None:
        for worker in attempt.workers:
            if worker.reaped and self.guardian is not None:
                self.guardian.forget(worker.pid)

    async def release(self) -> None:
        """Leave no worker, zombie or pidfd behind (the embedded API outlives us).

        After a success the workers exited by themselves and were never stopped; when
        cancelled (an embedded caller gave up) they may still run. Either way the usual
        stop (TERM, grace, KILL, sweep, reap) finishes them, at once for exited ones.
        """
        attempt = self.attempt
        unreaped = [w for w in attempt.workers if not w.reaped] if attempt else []
        if attempt is None or not unreaped:
            return
        with anyio.CancelScope(shield=True):
            await self._standbys_in()
            async with anyio.create_task_group() as tg:
                for worker in unreaped:
                    if not worker.exited.is_set():  # its monitor was cancelled
                        tg.start_soon(_mark_exited, worker)
                await stop_group(
                    unreaped, signum=signal.SIGTERM, grace=self.settings.shutdown_timeout,
                    kill_now=attempt.kill_now, sweep_adopted=self.sweep_adopted,
                    exempt=self.exempt(),
                )
                tg.cancel_scope.cancel()
            self._forget_reaped(attempt)


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


async def _mark_exited(worker: Worker) -> None:
    """A stand-in monitor for ``stop_group`` once the real monitors are cancelled."""
    await wait_exit(worker)
    worker.exited.set()


def _next_attempt_index(run_dir: Path) -> int:
    """Attempt directories continue after any left by an earlier run: nothing is overwritten."""
    highest = -1
    try:
        for entry in os.scandir(run_dir):
            name = entry.name
            index = name[8:]
            if name.startswith("attempt_") and index.isascii() and index.isdigit():
                highest = max(highest, int(index))
    except OSError:
        return 0
    return highest + 1


def settings_command(settings: Settings, environ: Mapping[str, str]) -> CommandFor:
    """The command of each rank as torchrun builds it from the flags."""
    python = environ.get("PYTHON_EXEC", sys.executable)

    def command(local_rank: int, global_rank: int, rank_dir: Path) -> list[str]:
        return worker_argv(
            python, settings.training_script, settings.training_script_args, local_rank,
            module=settings.module, no_python=settings.no_python, run_path=settings.run_path,
        )

    return command
