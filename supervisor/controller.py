"""The controller: consumes events, runs the pure state machine, carries out decisions.

It is the only code that changes supervisor state. Tasks elsewhere (signals, watchdog,
health, rendezvous poller, worker monitors) only report events into its inbox. Long
actions (rendezvous, backoff, exit barrier, stopping a group) run as tasks in the
controller's own task group and report back with an event when done, so the controller
always stays responsive (a second SIGTERM during a stop escalates at once).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import anyio
import msgspec
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from supervisor.config import Settings
from supervisor.core import state as sm
from supervisor.core.envs import GroupLayout, interpreter, worker_argv, worker_env
from supervisor.core.policy import RestartPolicy
from supervisor.core.snapshot import (
    FailureView,
    ProgressTable,
    RendezvousView,
    Snapshot,
    WorkerView,
)
from supervisor.events import EventLog
from supervisor.rendezvous.base import Rendezvous, RendezvousError, RendezvousResult
from supervisor.workers.errorfile import read_error_file
from supervisor.workers.guardian import Guardian
from supervisor.workers.output import OutputPlan
from supervisor.workers.spawn import (
    DeathSignal,
    Worker,
    WorkerSpec,
    signal_workers,
    spawn_worker,
    wait_exit,
)
from supervisor.workers.standby import Standby, discard_all, spawn_standby
from supervisor.workers.stop import stop_group

if TYPE_CHECKING:
    from supervisor.accounting import GoodputRecorder

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------- inbox commands


class ForwardSignal(msgspec.Struct, frozen=True):
    """Pass a signal (SIGUSR1/SIGUSR2 preemption notices) to every worker; nothing else."""

    signum: int


class ReopenLogs(msgspec.Struct, frozen=True):
    """SIGHUP: reopen log files (logrotate); workers are not touched."""


Command = ForwardSignal | ReopenLogs
# (local_rank, global_rank, rank_dir) -> argv of that rank's worker
CommandFor = Callable[[int, int, Path], list[str]]
# local_rank -> CPUs to bind the worker to, or None
CpusFor = Callable[[int], tuple[int, ...] | None]
# wraps a shutdown stop (e.g. asks systemd for more time while the grace runs)
StopGuard = Callable[[], AbstractAsyncContextManager[None]]
Inbox = MemoryObjectReceiveStream[sm.Event | Command]
Outbox = MemoryObjectSendStream[sm.Event | Command]


class Observer(Protocol):
    """Something that wants to hear about the run (metrics, systemd, watchdog)."""

    def on_transition(
        self, old: sm.State, new: sm.State, event: sm.Event, decision: sm.Decision
    ) -> None: ...

    def on_launch(self, attempt: Attempt) -> None: ...

    def on_stopped(self, attempt: Attempt) -> None: ...


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

    def error_file(self, local_rank: int) -> Path:
        return self.directory / str(local_rank) / "error.json"


class SnapshotHub:
    """Holds the latest published Snapshot; readers wait for changes without polling."""

    def __init__(self, first: Snapshot) -> None:
        self.current = first
        self.version = 0
        self._changed = anyio.Event()

    def publish(self, snapshot: Snapshot) -> None:
        self.current = snapshot
        self.version += 1
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_changed(self, seen: int) -> int:
        while self.version == seen:
            await self._changed.wait()
        return self.version


class Controller:
    """Owns the state machine and the live worker group."""

    def __init__(
        self,
        settings: Settings,
        rendezvous: Rendezvous,
        *,
        run_id: str,
        events: EventLog,
        hub: SnapshotHub,
        log_root: Path,
        output: OutputPlan,
        environ: Mapping[str, str],
        timer_file: str | None,
        guardian: Guardian | None = None,
        sweep_adopted: bool = True,
        exempt_pids: Iterable[int] = (),
        observers: Sequence[Observer] = (),
        command: CommandFor | None = None,
        cpus: CpusFor | None = None,
        progress: ProgressTable | None = None,
        stop_guard: StopGuard | None = None,
        goodput: GoodputRecorder | None = None,
    ) -> None:
        self.settings = settings
        self.rendezvous = rendezvous
        self.run_id = run_id
        self.events = events
        self.hub = hub
        self.log_root = log_root
        self.output = output
        self.environ = dict(environ)
        self.timer_file = timer_file
        self.guardian = guardian
        self.sweep_adopted = sweep_adopted
        self.exempt_pids = set(exempt_pids)
        self.observers = list(observers)
        self.command = command or settings_command(settings, self.environ)
        self.cpus = cpus or (lambda local_rank: None)
        self.progress = progress or ProgressTable()
        self.stop_guard = stop_guard
        self.goodput = goodput  # also one of the observers; read for snapshots, summary
        self.started = time.monotonic()
        # transitions so far, for an observer that attaches late (the metrics, created
        # after the first launch so their imports do not delay it); None once replayed
        self._replay: list[tuple[sm.State, sm.State, sm.Event, sm.Decision]] | None = []
        base, top = settings.backoff
        self.policy = RestartPolicy(
            max_restarts=settings.max_restarts,
            backoff_base=base,
            backoff_max=top,
            budget_window=settings.restart_budget_window,
            no_restart_exit_codes=frozenset(settings.no_restart_exit_codes),
            restart_exit_codes=(
                frozenset(settings.restart_exit_codes)
                if settings.restart_exit_codes is not None
                else None
            ),
        )
        self.state = sm.State()
        self.attempt: Attempt | None = None
        self.round: RendezvousResult | None = None
        self.death = DeathSignal()
        self._dir_base = _next_attempt_index(log_root / run_id)
        self._action = anyio.CancelScope()
        self._tg: TaskGroup | None = None
        self._send: Outbox | None = None
        self._rng = random.Random()
        self._started_wall = time.time()
        self._launched_once = anyio.Event()
        self.standbys: dict[int, Standby] = {}  # local rank -> its warm interpreter
        self._python = self.environ.get("PYTHON_EXEC", sys.executable)

    # ------------------------------------------------------------------ main loop
    async def run(self, inbox: Inbox, outbox: Outbox) -> int:
        """Run until a final state; return the process exit code."""
        self._send = outbox
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                self._publish()
                self._execute(sm.StartRendezvous())
                async for item in inbox:
                    if isinstance(item, ForwardSignal | ReopenLogs):
                        self._command(item)
                        continue
                    self._apply(item)
                    if self.state.phase.final:
                        break
                tg.cancel_scope.cancel()
        finally:
            await self._release_workers()
            self._discard_standbys()
        self._summarise()
        return self.state.exit_code if self.state.exit_code is not None else 1

    async def _release_workers(self) -> None:
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
            async with anyio.create_task_group() as tg:
                for worker in unreaped:
                    if not worker.exited.is_set():  # its monitor was cancelled
                        tg.start_soon(_mark_exited, worker)
                await stop_group(
                    unreaped, signum=signal.SIGTERM, grace=self.settings.shutdown_timeout,
                    kill_now=attempt.kill_now, sweep_adopted=self.sweep_adopted,
                    exempt=self._exempt(),
                )
                tg.cancel_scope.cancel()
            for worker in unreaped:
                if worker.reaped and self.guardian is not None:
                    self.guardian.forget(worker.pid)

    def attach_late(self, observer: Observer) -> None:
        """Add an observer and replay to it every transition made so far."""
        for step in self._replay or ():
            observer.on_transition(*step)
        self._replay = None
        self.observers.append(observer)

    @property
    def launched(self) -> anyio.Event:
        """Set once the first worker group has been launched (for READY=1)."""
        return self._launched_once

    def _post(self, event: sm.Event | Command) -> None:
        assert self._send is not None
        self._send.send_nowait(event)

    def _apply(self, event: sm.Event) -> None:
        if self._stale(event):
            logger.debug("dropping stale %s", event)
            return
        self._record(event)
        old = self.state
        new, decision = sm.transition(old, event, self.policy)
        self.state = new
        self.events.attempt = new.attempt
        if new.phase is not old.phase:
            logger.info("%s -> %s (%s)", old.phase.value, new.phase.value, type(event).__name__)
            self.events.emit(
                "state", old=old.phase.value, new=new.phase.value, cause=type(event).__name__,
                reason=(new.stop_reason.value if new.stop_reason else None),
            )
        if new.phase is sm.Phase.FAILED and old.stop_reason is sm.StopReason.FAILURE:
            self.events.emit("restart_refused", reason=new.last_decision_reason,
                             restart_count=new.restart_count)
        for observer in self.observers:
            observer.on_transition(old, new, event, decision)
        if self._replay is not None:
            self._replay.append((old, new, event, decision))
        self._publish()
        self._execute(decision)

    def _record(self, event: sm.Event) -> None:
        """Event-log lines for inputs that are not state changes by themselves."""
        if isinstance(event, sm.DeadlineExpired):
            self.events.emit(
                "deadline_expired", local_rank=event.local_rank, pid=event.pid,
                scope=event.scope, late=round(event.late, 6),
            )
        elif isinstance(event, sm.WorkerUnhealthy):
            self.events.emit(
                "worker_unhealthy", local_rank=event.local_rank, pid=event.pid,
                reason=event.reason,
            )

    def _stale(self, event: sm.Event) -> bool:
        attempt = getattr(event, "attempt", None)
        if isinstance(event, sm.GroupLaunched):
            return False
        return attempt is not None and attempt != self.state.attempt

    def _command(self, command: Command) -> None:
        if isinstance(command, ForwardSignal):
            workers = self.attempt.workers if self.attempt else []
            logger.info("forwarding %s to %d workers", _signame(command.signum), len(workers))
            signal_workers(workers, command.signum)
            self.events.emit("signal_forwarded", signal=_signame(command.signum))
        else:
            logger.info("reopening log files")
            self.events.reopen()
            self.output.reopen()
            self.events.emit("logs_reopened")

    # ------------------------------------------------------------------ decisions
    def _execute(self, decision: sm.Decision) -> None:
        match decision:
            case sm.Nothing() | sm.Exit():
                if isinstance(decision, sm.Exit):
                    self._finish(decision)
            case sm.StartRendezvous():
                self._start_action(self._rendezvous_round)
            case sm.LaunchGroup():
                self._launch(decision)
            case sm.StopGroup():
                self._stop(decision)
            case sm.KillGroupNow():
                if self.attempt is not None:
                    logger.warning("second stop request: killing the worker group now")
                    self.attempt.kill_now.set()
            case sm.StartBackoff():
                self._backoff(decision)
            case sm.EnterExitBarrier():
                self._start_action(self._exit_barrier)

    def _start_action(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Run one background action (rendezvous, backoff, barrier); replaces the last."""
        self._action.cancel()
        scope = anyio.CancelScope()
        self._action = scope

        async def body() -> None:
            with scope:
                await fn()

        assert self._tg is not None
        self._tg.start_soon(body)

    async def _rendezvous_round(self) -> None:
        started = time.monotonic()
        try:
            result = await self.rendezvous.next_round(self.settings.local_world_size)
        except RendezvousError as exc:
            self._post(sm.RendezvousFailed(str(exc), time.monotonic()))
            return
        self.round = msgspec.structs.replace(result, duration=time.monotonic() - started)
        job_restarts = await self._job_restarts()
        self.events.emit(
            "rendezvous", round=result.round, group_rank=result.group_rank,
            group_world_size=result.group_world_size, world_size=result.world_size,
            master_addr=result.master_addr, master_port=result.master_port,
            members=list(result.members), duration=round(self.round.duration, 6),
        )
        self._post(sm.RendezvousComplete(result.round, result.world_size, job_restarts))

    async def _job_restarts(self) -> int:
        try:
            return await self.rendezvous.restart_count()
        except RendezvousError as exc:
            logger.warning("cannot read the job-wide restart count: %s", exc)
            return self.state.restart_count

    async def _exit_barrier(self) -> None:
        assert self.round is not None
        if self.attempt is not None:
            await self.output.drain(self.attempt.dir_index)  # logs complete before success
        result = await self.rendezvous.exit_barrier(
            self.round, self.settings.exit_barrier_timeout
        )
        self.events.emit("exit_barrier", ok=result.ok, message=result.message or None)
        self._post(sm.BarrierDone(result.ok, result.message))

    def _backoff(self, decision: sm.StartBackoff) -> None:
        self.events.emit(
            "restart_scheduled", delay=round(decision.delay, 6), reason=decision.reason,
            ceiling=decision.ceiling,
            restart_count=self.state.restart_count,
            budget_left=self.policy.budget_left(self.state.history, time.monotonic()),
        )
        logger.warning("restarting the worker group: %s", decision.reason)

        async def wait() -> None:
            try:  # count it job-wide first, so every node sees the same budget
                await self.rendezvous.record_failure_restart(decision.reason)
            except RendezvousError as exc:
                logger.warning("cannot record the restart job-wide: %s", exc)
            await anyio.sleep(decision.delay)
            self._post(sm.BackoffElapsed())

        self._start_action(wait)

    # ------------------------------------------------------------------ the group
    def _launch(self, decision: sm.LaunchGroup) -> None:
        assert self.round is not None and self._tg is not None
        rnd = self.round
        dir_index = self._dir_base + decision.attempt - 1
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
            restart_count=decision.restart_count,
            max_restarts=self.settings.max_restarts,
            virtual_local_rank=self.settings.virtual_local_rank,
        )
        attempt = Attempt(
            decision.attempt, dir_index, self.log_root / self.run_id / f"attempt_{dir_index}",
            rnd, layout,
        )
        self.attempt = attempt
        self.events.attempt = decision.attempt
        self.progress.reset(decision.attempt)
        failed_to_start: list[tuple[int, str]] = []
        for local_rank in range(layout.local_world_size):
            try:
                attempt.workers.append(self._spawn(attempt, local_rank))
            except OSError as exc:
                logger.error("cannot start local rank %d: %s", local_rank, exc)
                failed_to_start.append((local_rank, str(exc)))
        self._tg.start_soon(self._attempt_tasks, attempt)
        self.events.emit(
            "group_started", restart_count=decision.restart_count, dir=str(attempt.directory),
            pids={w.local_rank: w.pid for w in attempt.workers},
            warm=[w.local_rank for w in attempt.workers if w.extra.get("warm")] or None,
            master_addr=layout.master_addr, master_port=layout.master_port,
            cpus={w.local_rank: list(w.spec.cpus) for w in attempt.workers if w.spec.cpus}
            or None,
        )
        for observer in self.observers:
            observer.on_launch(attempt)
        now = time.monotonic()
        self._apply(
            sm.GroupLaunched(decision.attempt, frozenset(range(layout.local_world_size)), now)
        )
        for local_rank, message in failed_to_start:
            self._post(sm.WorkerExited(decision.attempt, local_rank, 0, 127, None, now, message))
        self._launched_once.set()
        if self._restart_possible(decision.restart_count):
            # now, before any event of this attempt is handled: a stop that began first
            # would take a newer standby for debris and sweep it
            self._prepare_standbys(attempt)

    def _spawn(self, attempt: Attempt, local_rank: int) -> Worker:
        rank_dir = attempt.directory / str(local_rank)
        rank_dir.mkdir(parents=True, exist_ok=True)
        error_file = attempt.error_file(local_rank)
        env = worker_env(
            self.environ, attempt.layout, local_rank,
            error_file=str(error_file), timer_file=self.timer_file,
        )
        global_rank = attempt.layout.rank_offset + local_rank
        argv = self.command(local_rank, global_rank, rank_dir)
        stdout, stderr = self.output.open_rank(
            attempt.dir_index, rank_dir, local_rank, global_rank,
            restart_count=attempt.layout.restart_count,
        )
        spec = WorkerSpec(
            local_rank, global_rank, argv, env, stdout, stderr, cpus=self.cpus(local_rank)
        )
        try:
            worker = self._warm_start(spec)
            if worker is None:
                worker = spawn_worker(spec, self.death)
                if self.guardian is not None:
                    self.guardian.watch(worker.pid)
        finally:
            self.output.after_spawn(local_rank)
        logger.debug("local rank %d started as pid %d", local_rank, worker.pid)
        return worker

    # ------------------------------------------------------------------ warm restarts
    def _restart_possible(self, restart_count: int) -> bool:
        """Whether another attempt may follow this one (so standbys are worth their memory):
        failure restarts left, or a backend whose membership can change."""
        if self.settings.no_warm_restart:
            return False
        return self.settings.rdzv_backend != "static" or restart_count < self.settings.max_restarts

    def _prepare_standbys(self, attempt: Attempt) -> None:
        """Start a standby interpreter for every local rank whose command can run warm."""
        for worker in attempt.workers:
            rank = worker.local_rank
            if rank in self.standbys or not Standby.accepts(interpreter(self._python),
                                                             worker.spec.argv):
                continue
            try:
                standby = spawn_standby(
                    rank, self._python, self.environ, self.death, cwd=worker.spec.cwd,
                    cpus=worker.spec.cpus,
                )
            except OSError as exc:
                logger.warning("cannot start a standby for local rank %d: %s", rank, exc)
                return
            self.standbys[rank] = standby
            if self.guardian is not None:
                self.guardian.watch(standby.pid)
            logger.debug("standby for local rank %d started as pid %d", rank, standby.pid)

    def _warm_start(self, spec: WorkerSpec) -> Worker | None:
        """Start the worker in its rank's standby; None if there is none or it cannot."""
        standby = self.standbys.pop(spec.local_rank, None)
        if standby is None:
            return None
        worker = standby.go(spec) if Standby.accepts(standby.prefix, spec.argv) else None
        if worker is None:
            standby.discard()
            if self.guardian is not None:
                self.guardian.forget(standby.pid)
            return None
        worker.extra["warm"] = True
        return worker

    def _discard_standbys(self) -> None:
        for pid in discard_all(self.standbys):
            if self.guardian is not None:
                self.guardian.forget(pid)

    def _exempt(self) -> set[int]:
        """Our children a group's sweep must not kill: the guardian and the standbys."""
        return self.exempt_pids | {s.pid for s in self.standbys.values()}

    async def _attempt_tasks(self, attempt: Attempt) -> None:
        """The attempt's monitors and membership watch; cancelled when it is stopped."""
        with attempt.scope:
            async with anyio.create_task_group() as tg:
                for worker in attempt.workers:
                    tg.start_soon(self._monitor, attempt, worker)
                tg.start_soon(self._watch_membership, attempt)

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
            signal=_signame(status.signal) if status.signal else None,
            message=message or None,
        )
        self._post(
            sm.WorkerExited(
                attempt.number, worker.local_rank, worker.pid, status.exit_code,
                status.signal, status.at, message,
            )
        )

    async def _watch_membership(self, attempt: Attempt) -> None:
        try:
            reason = await self.rendezvous.wait_membership_change(attempt.round)
        except RendezvousError as exc:
            reason = f"rendezvous lost: {exc}"
        self.events.emit("membership_changed", reason=reason)
        self._post(sm.MembershipChanged(reason))

    def _stop(self, decision: sm.StopGroup) -> None:
        if decision.reason in (sm.StopReason.SHUTDOWN, sm.StopReason.FATAL):
            self._action.cancel()  # no more rendezvous, backoff or barrier
        attempt = self.attempt
        root = self.state.root_cause
        self.events.emit(
            "group_stopping", reason=decision.reason.value, signal=_signame(decision.signum),
            root_cause=root.describe() if root else None,
        )
        if root is not None and decision.reason is sm.StopReason.FAILURE:
            logger.error("worker group failed: %s", root.describe())
        assert self._tg is not None
        self._tg.start_soon(self._stop_attempt, attempt, decision)

    async def _stop_attempt(self, attempt: Attempt | None, decision: sm.StopGroup) -> None:
        started = time.monotonic()
        guard = (
            self.stop_guard()
            if self.stop_guard is not None and decision.reason is sm.StopReason.SHUTDOWN
            else nullcontext()
        )
        async with guard:
            await self._stop_workers(attempt, decision)
        self.events.emit("group_stopped", seconds=round(time.monotonic() - started, 6))
        self._post(sm.GroupStopped(time.monotonic(), self._rng.random()))

    async def _stop_workers(self, attempt: Attempt | None, decision: sm.StopGroup) -> None:
        if attempt is not None and attempt.workers:
            await stop_group(
                attempt.workers,
                signum=decision.signum,
                grace=self.settings.shutdown_timeout,
                kill_now=attempt.kill_now,
                sweep_adopted=self.sweep_adopted,
                exempt=self._exempt(),
            )
            attempt.scope.cancel()
            for worker in attempt.workers:
                if worker.reaped and self.guardian is not None:
                    self.guardian.forget(worker.pid)
            await self.output.drain(attempt.dir_index)
            for observer in self.observers:
                observer.on_stopped(attempt)

    # ------------------------------------------------------------------ the end
    def _finish(self, decision: sm.Exit) -> None:
        self._action.cancel()
        root = self.state.root_cause
        self.events.emit(
            "finished", phase=self.state.phase.value, exit_code=decision.code,
            reason=decision.reason, restart_count=self.state.restart_count,
            root_cause=root.describe() if root else None,
        )

    def _summarise(self) -> None:
        s = self.state
        if self.goodput is not None:
            logger.info("%s", self.goodput.summary_line())
        if s.phase is sm.Phase.SUCCEEDED:
            logger.info("job succeeded after %d restart(s)", s.restart_count)
            return
        logger.error("job %s (exit code %s): %s", s.phase.value, s.exit_code,
                     s.last_decision_reason)
        failure = s.root_cause or s.last_failure
        if failure is None or self.attempt is None:
            return
        attempt = self.attempt
        lines = ["failure summary:", f"  root cause: {failure.describe()}"]
        if failure.local_rank is not None:
            rank = attempt.layout.rank_offset + failure.local_rank
            lines.append(f"  rank {rank} (local {failure.local_rank}), attempt {failure.attempt}")
            lines.append(f"  error file: {attempt.error_file(failure.local_rank)}")
            lines.append(f"  logs: {attempt.directory / str(failure.local_rank)}")
        for worker in attempt.workers:
            st = worker.status
            outcome = (
                "running" if st is None
                else f"exit {st.exit_code}" if st.exit_code is not None
                else f"signal {_signame(st.signal or 0)}"
            )
            lines.append(f"  local rank {worker.local_rank} pid {worker.pid}: {outcome}")
        logger.error("\n".join(lines))

    # ------------------------------------------------------------------ snapshots
    def live_worker_ranks(self) -> dict[int, int]:
        """{pid: local rank} of the current attempt's workers that have not exited.

        Empty unless the group is running: deadlines posted while a group is stopping or
        before it started are not progress and must not be enforced.
        """
        attempt = self.attempt
        if attempt is None or self.state.phase is not sm.Phase.RUNNING:
            return {}
        return {w.pid: w.local_rank for w in attempt.workers if w.status is None}

    def _publish(self) -> None:
        self.hub.publish(self.snapshot())

    def snapshot(self) -> Snapshot:
        s = self.state
        attempt = self.attempt
        workers: tuple[WorkerView, ...] = ()
        if attempt is not None:
            workers = tuple(_worker_view(w, s.phase) for w in attempt.workers)
        rnd = self.round
        return Snapshot(
            run_id=self.run_id,
            phase=s.phase.value,
            attempt=s.attempt,
            restart_count=s.restart_count,
            max_restarts=self.settings.max_restarts,
            restarts_left=self.policy.budget_left(s.history, time.monotonic()),
            world_size=rnd.world_size if rnd else 0,
            local_world_size=self.settings.local_world_size,
            role=self.settings.role,
            published_at=time.monotonic(),
            started_at_wall=self._started_wall,
            workers=workers,
            last_failure=self._failure_view(s.last_failure),
            rendezvous=RendezvousView(
                backend=self.rendezvous.backend,
                round=rnd.round if rnd else 0,
                members=rnd.members if rnd else (),
                group_rank=rnd.group_rank if rnd else 0,
                group_world_size=rnd.group_world_size if rnd else 0,
                last_duration=rnd.duration if rnd else None,
            ),
            watchdog_enabled=self.timer_file is not None,
            progress_timeout=self.settings.progress_timeout,
            status_line=self.status_line(),
            exit_code=s.exit_code,
            goodput=self.goodput.ledger() if self.goodput is not None else None,
            ready_when=self.settings.ready_when,
        )

    def status_line(self) -> str:
        s = self.state
        n = self.settings.local_world_size
        up = len(s.running) if s.phase is sm.Phase.RUNNING else 0
        budget = f"restarts {s.restart_count}/{self.settings.max_restarts}"
        return f"{s.phase.value} attempt {s.attempt}: {up}/{n} workers, {budget}"

    def _failure_view(self, failure: sm.Failure | None) -> FailureView | None:
        if failure is None:
            return None
        offset = self.attempt.layout.rank_offset if self.attempt else 0
        error_file = None
        if self.attempt is not None and failure.local_rank is not None:
            error_file = str(self.attempt.error_file(failure.local_rank))
        return FailureView(
            kind=failure.kind.value,
            attempt=failure.attempt,
            local_rank=failure.local_rank,
            global_rank=None if failure.local_rank is None else offset + failure.local_rank,
            pid=failure.pid,
            exit_code=failure.exit_code,
            signal=failure.signal,
            message=failure.message,
            description=failure.describe(),
            at_wall=time.time() - (time.monotonic() - failure.at),
            error_file=error_file,
        )


async def _mark_exited(worker: Worker) -> None:
    """A stand-in monitor for ``stop_group`` once the real monitors are cancelled."""
    await wait_exit(worker)
    worker.exited.set()


def _worker_view(worker: Worker, phase: sm.Phase) -> WorkerView:
    st = worker.status
    if st is None:
        state = "running"
    elif st.ok:
        state = "succeeded"
    elif phase is sm.Phase.STOPPING:
        state = "stopped"
    else:
        state = "failed"
    return WorkerView(
        local_rank=worker.local_rank,
        global_rank=worker.spec.global_rank,
        pid=worker.pid,
        state=state,
        started_at=worker.started_at_wall,
        exit_code=st.exit_code if st else None,
        signal=st.signal if st else None,
        cpu_affinity=worker.spec.cpus,
    )


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


def _signame(signum: int | None) -> str:
    return sm.signal_name(signum) if signum else ""


def settings_command(settings: Settings, environ: Mapping[str, str]) -> CommandFor:
    """The command of each rank as torchrun builds it from the flags."""
    python = environ.get("PYTHON_EXEC", sys.executable)

    def command(local_rank: int, global_rank: int, rank_dir: Path) -> list[str]:
        return worker_argv(
            python, settings.training_script, settings.training_script_args, local_rank,
            module=settings.module, no_python=settings.no_python, run_path=settings.run_path,
        )

    return command
