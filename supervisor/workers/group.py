"""The worker group: one attempt's processes, from launch to the last reap.

``WorkerGroup`` owns an attempt's life: its directory, each rank's environment and output,
the start of each rank (through the warm pool's standby, else a cold spawn), a monitor per
worker that reports its exit, and the stop (TERM, grace, KILL, sweep, reap). Standbys are
the pool's (``warm.pool``). It reports what happens as events into the controller's inbox
(``post``) and never calls back into the controller.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel

from supervisor.config import Settings
from supervisor.core import state as sm
from supervisor.core.envs import GroupLayout, worker_argv, worker_env
from supervisor.core.numa import CpusFor as CpusFor
from supervisor.events import EventLog
from supervisor.rendezvous.base import RendezvousResult
from supervisor.workers import nodecheck
from supervisor.workers.attempt import Attempt as Attempt
from supervisor.workers.attempt import WorkerFailure as WorkerFailure
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
from supervisor.workers.stop import stop_group
from supervisor.workers.warm.base import NullPool, Pool, Preview

logger = logging.getLogger(__name__)

# (local_rank, global_rank, rank_dir) -> argv of that rank's worker
CommandFor = Callable[[int, int, Path], list[str]]
Post = Callable[[sm.Event], None]


class AttemptPrepError(OSError):
    """The supervisor could not prepare an attempt (its own failure, not the workers')."""


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
        death: DeathSignal,
        pool: Pool | None = None,
        guardian: Guardian | None = None,
        sweep_adopted: bool = True,
        exempt_pids: Iterable[int] = (),
        command: CommandFor | None = None,
        cpus: CpusFor | None = None,
        spawner: Spawner = SPAWNER,
    ) -> None:
        self.settings = settings
        self.spawner = spawner  # forks every worker (spawn.Spawner says why)
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
        self.death = death
        self.pool: Pool = pool if pool is not None else NullPool()
        self.attempt: Attempt | None = None
        self.dir_base = _next_attempt_index(log_root / run_id)

    # ------------------------------------------------------------------ launch
    async def launch(
        self, number: int, restart_count: int, rnd: RendezvousResult
    ) -> tuple[Attempt, list[tuple[int, str]]]:
        """Start every local rank of attempt ``number``; returns it and ranks that failed."""
        attempt = self.begin(number, restart_count, rnd)
        return attempt, await self.start(attempt)

    def begin(self, number: int, restart_count: int, rnd: RendezvousResult) -> Attempt:
        """Attempt ``number``, its directory made: the current attempt from now on (a stop
        decided while its ranks start stops it). Raises ``AttemptPrepError``."""
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
        self.attempt = attempt
        self.pool.begin(attempt)
        return attempt

    async def start(self, attempt: Attempt) -> list[tuple[int, str]]:
        """Prepare, then start, every local rank of ``attempt``; the ranks that failed to
        start. The event loop runs between two ranks (opening a rank's logs and starting
        it take a millisecond or two each: eight at once held /healthz for tens of
        milliseconds at every restart). If a stop of the attempt is decided meanwhile, no
        further rank is started. Raises ``AttemptPrepError`` with nothing started."""
        try:
            specs = await self._prepare(attempt)
            failed_to_start: list[tuple[int, str]] = []
            for index, spec in enumerate(specs):
                if not attempt.stopping:
                    await self.pool.ready(spec.local_rank)
                if attempt.stopping:
                    self._release(specs[index:])
                    break
                try:
                    attempt.workers.append(self._start(spec))
                except OSError as exc:
                    logger.error("cannot start local rank %d: %s", spec.local_rank, exc)
                    failed_to_start.append((spec.local_rank, str(exc)))
                await anyio.lowlevel.checkpoint()
            self.pool.launched(attempt)
            return failed_to_start
        finally:
            attempt.started.set()

    async def settle(self) -> None:
        """Before a launch: the standbys still to come that are worth waiting for
        (``Pool.settle``)."""
        await self.pool.settle()

    def preview(self) -> Preview | None:
        """Every rank's command, environment and CPUs as the first attempt will have them,
        before the rendezvous (its per-attempt values are placeholders: a standby never
        starts with those); None if they cannot be told yet."""
        layout = GroupLayout(
            run_id=self.run_id, role=self.settings.role,
            local_world_size=self.settings.local_world_size, group_rank=0,
            group_world_size=1, rank_offset=0, world_size=self.settings.local_world_size,
            master_addr="", master_port=0, restart_count=0,
            max_restarts=self.settings.max_restarts,
            virtual_local_rank=self.settings.virtual_local_rank,
        )
        place = self.log_root / self.run_id / "preview"  # never made: only a name
        try:
            ranks = range(layout.local_world_size)
            envs = [worker_env(self.environ, layout, rank, error_file=str(place),
                               timer_file=self.timer_file) for rank in ranks]
            return Preview(self.command(0, 0, place / "0"), envs,
                           [self.cpus(rank) for rank in ranks])
        except Exception:  # an invalid layout fails at the launch, with its own message
            return None

    def _rank_env(self, attempt: Attempt, local_rank: int) -> dict[str, str]:
        return worker_env(
            self.environ, attempt.layout, local_rank,
            error_file=str(attempt.error_file(local_rank)), timer_file=self.timer_file,
        )

    async def _prepare(self, attempt: Attempt) -> list[WorkerSpec]:
        """Directories, environment and output of every rank, before any is started (none,
        if a stop is decided meanwhile).

        A failure here (full disk, no inodes, a directory that cannot be made) is the
        supervisor's, not the workers': it raises ``AttemptPrepError`` with nothing left
        behind, and the caller retries without touching the restart budget."""
        specs: list[WorkerSpec] = []
        try:
            for local_rank in range(attempt.layout.local_world_size):
                if local_rank:
                    await anyio.lowlevel.checkpoint()
                if attempt.stopping:
                    self._release(specs)
                    return []
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
            self._release(specs)
            raise AttemptPrepError(f"cannot prepare {attempt.directory}: {exc}") from exc
        return specs

    def _release(self, specs: list[WorkerSpec]) -> None:
        """Close our copies of unstarted ranks' pipe ends: their pipes reach EOF."""
        for spec in specs:
            self.output.after_spawn(spec.local_rank)

    def _start(self, spec: WorkerSpec) -> Worker:
        try:
            worker = self.pool.take(spec)
            if worker is None:
                worker = self.spawner.call(spawn_worker, spec, self.death,
                                           start=self.pool.cold_start(spec.local_rank))
                if self.guardian is not None:
                    self.guardian.watch(worker.pid)
        finally:
            self.output.after_spawn(spec.local_rank)
        logger.debug("local rank %d started as pid %d", spec.local_rank, worker.pid)
        return worker

    def shown_attempt(self, number: int) -> int:
        """The attempt number users see, everywhere (summary, /status, events, metrics,
        STATUS): K of its ``attempt_K`` directory, torchrun's layout. It counts from 0 and
        continues after the directories an earlier run left under the same run id.
        ``number`` is the state machine's launch count (1 for the first launch); before
        the first launch this is the number the first attempt will get."""
        return self.dir_base + max(number, 1) - 1

    def attempt_dir(self, number: int) -> Path:
        """The directory of the attempt with state machine number ``number``."""
        return self.log_root / self.run_id / f"attempt_{self.shown_attempt(number)}"

    def exempt(self) -> set[int]:
        """Our children a group's sweep must not kill: the guardian, the rendezvous's
        children, the standbys and the node checks."""
        return self.exempt_pids | self.pool.pids() | nodecheck.running_pids()

    def stopping(self, attempt: Attempt | None) -> None:
        """A stop of ``attempt`` was decided: from now on no standby is planned for it."""
        if attempt is not None:
            attempt.stopping = True

    def close(self) -> None:
        """Kill the standbys (the run is over)."""
        self.pool.close()

    # ------------------------------------------------------------------ monitors
    async def supervise(
        self, attempt: Attempt, *also: Callable[[Attempt], Coroutine[Any, Any, None]]
    ) -> None:
        """The attempt's worker monitors (and ``also`` tasks), cancelled when it stops;
        beside them the pool's standbys for the next attempt (they outlive this one)."""
        async with anyio.create_task_group() as outer:
            outer.start_soon(self.pool.run, attempt)
            with attempt.scope:
                async with anyio.create_task_group() as tg:
                    for worker in attempt.workers:
                        tg.start_soon(self._monitor, attempt, worker)
                    for task in also:
                        tg.start_soon(task, attempt)

    async def _monitor(self, attempt: Attempt, worker: Worker) -> None:
        status = await wait_exit(worker)
        if status.exit_code not in (0, None) and not attempt.stopping:
            await _signal_deaths_first(attempt, worker)
        worker.exited.set()
        message = ""
        if not status.ok:
            report = read_error_file(attempt.error_file(worker.local_rank))
            message = report.summary if report else ""
        signame = sm.signal_name(status.signal) if status.signal else None
        self.events.emit(
            "worker_exited", local_rank=worker.local_rank, rank=worker.spec.global_rank,
            pid=worker.pid, exit_code=status.exit_code, signal=signame, message=message or None,
        )
        if not status.ok and not attempt.stopping:
            attempt.failures.append(WorkerFailure(
                worker.local_rank, worker.spec.global_rank, worker.pid, status.exit_code,
                signame, message, time.time()))
        self.post(
            sm.WorkerExited(
                attempt.number, worker.local_rank, worker.pid, status.exit_code,
                status.signal, status.at, message,
            )
        )

    # ------------------------------------------------------------------ stop
    async def stop(self, attempt: Attempt | None, signum: int) -> None:
        """Stop the attempt's workers: ``signum``, the grace, SIGKILL, sweep, reap."""
        self.stopping(attempt)
        if attempt is not None:
            await attempt.started.wait()  # it starts no further rank once it sees the stop
        await self.pool.halt(attempt)
        if attempt is None or not attempt.workers:
            return
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
            await self.pool.halt()
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


PEER_POST_BOUND = 1.0  # s: a peer's monitor posts in the same loop pass; never wait longer


async def _signal_deaths_first(attempt: Attempt, worker: Worker) -> None:
    """A worker exited with a code while a peer already lies dead by a signal, both seen
    in one pass of the loop (whose order of the two means nothing): the peer's exit is
    posted first, so it is the attempt's root cause. A rank killed by a signal (SIGKILL
    from the OOM killer, SIGSEGV) is never the consequence of a peer's failure, while a
    rank whose peer vanished exits with a code (gloo's "Connection reset by peer")."""
    for peer in attempt.workers:
        if peer is worker or peer.exited.is_set():
            continue
        status = peer.poll_exit()
        if status is not None and status.signal is not None:
            with anyio.move_on_after(PEER_POST_BOUND):
                await peer.exited.wait()  # set by its monitor right before it posts

