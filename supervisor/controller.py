"""The controller: consumes events, runs the pure state machine, carries out decisions.

It is the only code that changes supervisor state. Tasks elsewhere (signals, watchdog,
health, rendezvous poller, worker monitors) only report events into its inbox. Long
actions (rendezvous, backoff, exit barrier, stopping a group) run as tasks in the
controller's own task group and report back with an event when done, so the controller
always stays responsive (a second SIGTERM during a stop escalates at once).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import msgspec
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from supervisor.config import Settings
from supervisor.core import state as sm
from supervisor.core.policy import RestartPolicy
from supervisor.core.snapshot import (
    FailureView,
    ProgressTable,
    RendezvousView,
    Snapshot,
    WorkerView,
)
from supervisor.events import EventLog
from supervisor.rendezvous.base import (
    Rendezvous,
    RendezvousClosed,
    RendezvousError,
    RendezvousResult,
)
from supervisor.workers.group import (
    Attempt,
    AttemptPrepError,
    CommandFor,
    CpusFor,
    WorkerGroup,
    settings_command,
)
from supervisor.workers.guardian import Guardian
from supervisor.workers.output import OutputPlan
from supervisor.workers.spawn import Worker, signal_workers

AUTO_SETTLE = 5.5  # s after a launch: a warm worker has recorded its imports at 1 and 5 s

__all__ = ["Attempt", "CommandFor", "Controller", "CpusFor", "ForwardSignal", "Observer",
           "ReopenLogs", "SnapshotHub", "settings_command"]

if TYPE_CHECKING:
    from supervisor.accounting import GoodputRecorder
    from supervisor.healing import Healing

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------- inbox commands


class ForwardSignal(msgspec.Struct, frozen=True):
    """Pass a signal (SIGUSR1/SIGUSR2 preemption notices) to every worker; nothing else."""

    signum: int


class ReopenLogs(msgspec.Struct, frozen=True):
    """SIGHUP: reopen log files (logrotate); workers are not touched."""


Command = ForwardSignal | ReopenLogs
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
        healing: Healing | None = None,
    ) -> None:
        self.settings = settings
        self.rendezvous = rendezvous
        self.run_id = run_id
        self.events = events
        self.hub = hub
        self.log_root = log_root
        self.output = output
        self.timer_file = timer_file
        self.guardian = guardian
        self.observers = list(observers)
        self.progress = progress or ProgressTable()
        self.stop_guard = stop_guard
        self.goodput = goodput  # also one of the observers; read for snapshots, summary
        self.healing = healing  # node checks, root causes, quarantine (supervisor.healing)
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
        self.round: RendezvousResult | None = None
        self.group = WorkerGroup(
            settings, run_id=run_id, events=events, log_root=log_root, output=output,
            environ=environ, timer_file=timer_file, post=self._post, guardian=guardian,
            sweep_adopted=sweep_adopted, exempt_pids=exempt_pids, command=command, cpus=cpus,
        )
        self.health_port: int | None = None  # set once the health socket is bound
        # the etcd backends' reachability and outages, for /status (set by the app)
        self.service_status: Callable[[], dict[str, Any]] | None = None
        self._action = anyio.CancelScope()
        self._tg: TaskGroup | None = None
        self._send: Outbox | None = None
        self._rng = random.Random()
        self._started_wall = time.time()
        self._launched_once = anyio.Event()

    @property
    def attempt(self) -> Attempt | None:
        """The current (or last) attempt of the worker group."""
        return self.group.attempt

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
            await self.group.release()
            self.group.discard_standbys()
        self._summarise()
        return self.state.exit_code if self.state.exit_code is not None else 1

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
        self.events.attempt = self.shown_attempt(new.attempt)
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
        if isinstance(event, sm.GroupLaunched | sm.LaunchFailed):
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
        if self.healing is not None:  # a held or failing node does not join
            quarantined = await self.healing.admit()
            if quarantined is not None:
                self._post(quarantined)
                return
        started = time.monotonic()
        try:
            result = await self.rendezvous.next_round(self.settings.local_world_size)
        except RendezvousClosed as exc:
            self._post(sm.RendezvousFailed(str(exc), time.monotonic(), exc.succeeded))
            return
        except RendezvousError as exc:
            self._post(sm.RendezvousFailed(str(exc), time.monotonic()))
            return
        if result.spare and self.healing is not None:
            self.healing.spare_admitted(result.round)
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
        if decision.counted:
            self.events.emit(
                "restart_scheduled", delay=round(decision.delay, 6), reason=decision.reason,
                ceiling=decision.ceiling,
                restart_count=self.state.restart_count,
                budget_left=self.policy.budget_left(self.state.history, time.monotonic()),
            )
            logger.warning("restarting the worker group: %s", decision.reason)
        else:
            self.events.emit("prepare_retry_scheduled", delay=round(decision.delay, 6),
                             reason=decision.reason)
            logger.warning("preparing the attempt again: %s", decision.reason)

        async def wait() -> None:
            try:  # count it job-wide first, so every node sees the same budget
                if decision.counted:
                    await self.rendezvous.record_failure_restart(decision.reason)
            except RendezvousError as exc:
                logger.warning("cannot record the restart job-wide: %s", exc)
            await anyio.sleep(decision.delay)
            self._post(sm.BackoffElapsed())

        self._start_action(wait)

    # ------------------------------------------------------------------ the group
    def _launch(self, decision: sm.LaunchGroup) -> None:
        assert self.round is not None and self._tg is not None
        group = self.group
        self.progress.reset(decision.attempt)
        self.events.attempt = self.shown_attempt(decision.attempt)
        try:
            attempt, failed_to_start = group.launch(decision.attempt, decision.restart_count,
                                                    self.round)
        except AttemptPrepError as exc:
            logger.error("%s (the supervisor's failure, not the workers': no restart is used)",
                         exc)
            self.events.emit("attempt_prepare_failed", message=str(exc))
            self._apply(sm.LaunchFailed(decision.attempt, str(exc), time.monotonic()))
            return
        self.events.attempt = self.shown_attempt(decision.attempt)  # a taken K was skipped
        self._tg.start_soon(group.supervise, attempt, self._watch_membership, self._watch_node)
        layout = attempt.layout
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
        if group.restart_possible(decision.restart_count):
            if group.preloading:
                self._tg.start_soon(self._preload_standbys, attempt)
            else:  # planned now, before any event of this attempt is handled
                self._tg.start_soon(group.start_standbys, group.plan_standbys(attempt))

    async def _preload_standbys(self, attempt: Attempt) -> None:
        """Preloading standbys for the next attempt, once this one has resumed.

        A standby that imports a framework costs seconds of CPU: started at once, it would
        compete with the very ranks that are resuming. So they start when every rank has
        shown progress in this attempt, or ``preload_after`` seconds after the launch for
        a job that shows none (their imports run at idle CPU priority in any case)."""
        launched = time.monotonic()
        with anyio.move_on_after(self.settings.preload_after):
            await self._all_progressed(attempt)
        if self.group.standby_options.auto:  # the workers' second record of their imports
            await anyio.sleep(max(0.0, launched + AUTO_SETTLE - time.monotonic()))
        if self.attempt is attempt and self.state.phase is sm.Phase.RUNNING:
            self.group.learn_store(attempt)
            await self.group.start_standbys(self.group.plan_standbys(attempt))

    async def _all_progressed(self, attempt: Attempt) -> None:
        """Return once every local rank of ``attempt`` has shown progress."""
        done = anyio.Event()
        ranks = attempt.layout.local_world_size

        def check() -> None:
            if self.progress.attempt == attempt.number and self.progress.count() >= ranks:
                done.set()

        self.progress.listeners.append(check)
        try:
            check()
            await done.wait()
        finally:
            self.progress.listeners.remove(check)

    def _exempt(self) -> set[int]:
        """Our children a group's sweep must not kill: the guardian and the standbys."""
        return self.group.exempt()

    async def _watch_membership(self, attempt: Attempt) -> None:
        try:
            reason = await self.rendezvous.wait_membership_change(attempt.round)
        except RendezvousError as exc:
            reason = f"rendezvous lost: {exc}"
        self.events.emit("membership_changed", reason=reason)
        self._post(sm.MembershipChanged(reason))

    async def _watch_node(self, attempt: Attempt) -> None:
        """The node check every interval while this attempt runs."""
        if self.healing is not None:
            self._post(await self.healing.watch())

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
            resolved = await self._stop_and_resolve(attempt, decision)
        if resolved is not None:  # before GroupStopped: it decides where the stop leads
            self._apply(resolved)
        self.events.emit("group_stopped", seconds=round(time.monotonic() - started, 6))
        self._post(sm.GroupStopped(time.monotonic(), self._rng.random()))

    async def _stop_and_resolve(self, attempt: Attempt | None, decision: sm.StopGroup
                                ) -> sm.Event | None:
        """Stop the workers; meanwhile, for a failure, ask whether it was another node's
        (a remote consequence) or the K-th of this node's (quarantine)."""
        root = self.state.root_cause
        if self.healing is None or root is None or decision.reason is not sm.StopReason.FAILURE:
            await self._stop_workers(attempt, decision)
            return None
        healing, found = self.healing, list[sm.Event | None]()
        rnd = self.round
        rank = None if root.local_rank is None or attempt is None else (
            attempt.layout.rank_offset + root.local_rank)

        async def resolve() -> None:
            found.append(await healing.resolve(root, rnd.round if rnd else 0, rank))

        async with anyio.create_task_group() as tg:
            tg.start_soon(resolve)
            await self._stop_workers(attempt, decision)
        return found[0] if found else None

    async def _stop_workers(self, attempt: Attempt | None, decision: sm.StopGroup) -> None:
        await self.group.stop(attempt, decision.signum)
        if attempt is not None and attempt.workers:
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
        self._summarise_losses()
        s = self.state
        if self.goodput is not None:
            logger.info("%s", self.goodput.summary_line())
        if s.phase is sm.Phase.SUCCEEDED:
            unchecked = self.rendezvous.backend == "static" and self.settings.max_nodes > 1
            logger.info("job succeeded after %d restart(s)%s", s.restart_count,
                        " on this node (static backend: the other nodes were not checked)"
                        if unchecked else "")
            return
        if s.phase is sm.Phase.STOPPED:
            # asked to stop (SIGTERM, systemctl stop): a clean end, not an error to alert on
            logger.info("job stopped (exit code %s): %s", s.exit_code, s.last_decision_reason)
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
            shown = self.shown_attempt(failure.attempt)
            lines.append(f"  rank {rank} (local {failure.local_rank}), attempt {shown}")
            lines.extend(f"  {line}" for line in self._rank_files(failure))
        for worker in attempt.workers:
            st = worker.status
            outcome = (
                "running" if st is None
                else f"exit {st.exit_code}" if st.exit_code is not None
                else f"signal {_signame(st.signal or 0)}"
            )
            lines.append(f"  local rank {worker.local_rank} pid {worker.pid}: {outcome}")
        logger.error("\n".join(lines))

    def _summarise_losses(self) -> None:
        """What a full disk cost: event-log records and worker output never written."""
        lost_events = self.events.loss_summary()
        if lost_events:
            logger.warning("%s", lost_events)
        lost_output = self.output.loss.lost_bytes
        if lost_output:
            logger.warning("%d bytes of worker output could not be written to the log files "
                           "(each gap is marked in its file)", lost_output)

    def _rank_files(self, failure: sm.Failure) -> list[str]:
        """Summary lines naming the failed rank's files that exist: its error file, its
        output logs, or where the output went instead (nothing redirected: the console)."""
        assert failure.local_rank is not None
        rank_dir = self.attempt_dir(failure.attempt) / str(failure.local_rank)
        lines = []
        error_file = rank_dir / "error.json"
        if error_file.is_file():
            lines.append(f"error file: {error_file}")
        logs = [str(rank_dir / n) for n in ("stdout.log", "stderr.log") if (rank_dir / n).is_file()]
        if logs:
            lines.append(f"logs: {', '.join(logs)}")
        else:
            lines.append("output: on the console above (--redirects or --tee keep it in files)")
        return lines

    def shown_attempt(self, number: int) -> int:
        """The attempt number users see, everywhere (summary, /status, events, metrics,
        STATUS): K of its ``attempt_K`` directory, torchrun's layout. It counts from 0 and
        continues after the directories an earlier run left under the same run id.
        ``number`` is the state machine's launch count (1 for the first launch); before
        the first launch this is the number the first attempt will get."""
        return self.group.dir_base + max(number, 1) - 1

    def attempt_dir(self, number: int) -> Path:
        """The directory of the attempt with state machine number ``number``."""
        return self.log_root / self.run_id / f"attempt_{self.shown_attempt(number)}"

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
            attempt=self.shown_attempt(s.attempt),
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
                etcd=self.service_status() if self.service_status is not None else None,
            ),
            watchdog_enabled=self.timer_file is not None,
            progress_timeout=self.settings.progress_timeout,
            status_line=self.status_line(),
            exit_code=s.exit_code,
            goodput=self.goodput.ledger() if self.goodput is not None else None,
            ready_when=self.settings.ready_when,
            node_health=self.healing.view() if self.healing and self.healing.enabled else None,
        )

    def status_line(self) -> str:
        s = self.state
        n = self.settings.local_world_size
        up = len(s.running) if s.phase is sm.Phase.RUNNING else 0
        budget = f"restarts {s.restart_count}/{self.settings.max_restarts}"
        shown = self.shown_attempt(s.attempt)
        line = f"{s.phase.value} attempt {shown}: {up}/{n} workers, {budget}"
        health = self.healing.status_line() if self.healing is not None else None
        if health is not None and s.phase is sm.Phase.RENDEZVOUS:
            line = f"{health}, {budget}"
        # the port actually used: it differs from the default when that one was busy
        return line if self.health_port is None else f"{line}, health port {self.health_port}"

    def _failure_view(self, failure: sm.Failure | None) -> FailureView | None:
        if failure is None:
            return None
        offset = self.attempt.layout.rank_offset if self.attempt else 0
        error_file = None
        if failure.local_rank is not None:
            path = self.attempt_dir(failure.attempt) / str(failure.local_rank) / "error.json"
            error_file = str(path) if path.is_file() else None  # only a file that exists
        return FailureView(
            kind=failure.kind.value,
            attempt=self.shown_attempt(failure.attempt),
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


def _signame(signum: int | None) -> str:
    return sm.signal_name(signum) if signum else ""
