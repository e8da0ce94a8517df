"""The controller: consumes events, runs the pure state machine, carries out decisions.

It is the only code that changes supervisor state. Tasks elsewhere (signals, watchdog,
health, membership watch, worker monitors) only report events into its inbox. Long
actions (rendezvous, backoff, exit barrier, stopping a group) run as tasks in the
controller's own task group and report back with an event when done, so the controller
always stays responsive (a second SIGTERM during a stop escalates at once). What readers
see (the status view, the status line, the summary) is the read model's (``views``).
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import TYPE_CHECKING, Protocol

import anyio
import msgspec
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from supervisor.config import Settings
from supervisor.core import state as sm
from supervisor.core.peers import CHECK_BOUND
from supervisor.core.policy import RestartPolicy
from supervisor.core.statusview import ProgressTable
from supervisor.events import EventLog
from supervisor.rendezvous.base import (
    Rendezvous,
    RendezvousClosed,
    RendezvousError,
    RendezvousResult,
)
from supervisor.rendezvous.watch import MembershipWatch
from supervisor.views import ReadModel, RunResult, StatusHub, signame
from supervisor.workers.group import (
    Attempt,
    AttemptPrepError,
    CommandFor,
    CpusFor,
    WorkerGroup,
    settings_command,
)
from supervisor.workers.output import OutputPlan
from supervisor.workers.spawn import signal_workers

__all__ = ["Attempt", "CommandFor", "Controller", "CpusFor", "ForwardSignal", "InboxItem",
           "Observer", "ReopenLogs", "RoundFormed", "StatusHub", "settings_command"]

if TYPE_CHECKING:
    from supervisor.healing import Healing

logger = logging.getLogger(__name__)

# failures a lost peer can cause (a broken collective exits, aborts or hangs)
PEER_KINDS = (sm.FailureKind.EXITED, sm.FailureKind.SIGNALED, sm.FailureKind.DEADLINE)


# ------------------------------------------------------------------- inbox commands


class ForwardSignal(msgspec.Struct, frozen=True):
    """Pass a signal (SIGUSR1/SIGUSR2 preemption notices) to every worker; nothing else."""

    signum: int


class ReopenLogs(msgspec.Struct, frozen=True):
    """SIGHUP: reopen log files (logrotate); workers are not touched."""


class RoundFormed(msgspec.Struct, frozen=True):
    """A rendezvous round formed: the state machine's event with the round it reports. The
    round becomes the controller's (and the read model's) only in the transition that
    accepts the event, never in the task that formed it."""

    result: RendezvousResult
    event: sm.RendezvousComplete


Command = ForwardSignal | ReopenLogs
InboxItem = sm.Event | Command | RoundFormed
# wraps a shutdown stop (e.g. asks systemd for more time while the grace runs)
StopGuard = Callable[[], AbstractAsyncContextManager[None]]
Inbox = MemoryObjectReceiveStream[InboxItem]
Outbox = MemoryObjectSendStream[InboxItem]


class Observer(Protocol):
    """Something that wants to hear about the run (metrics, systemd, watchdog)."""

    def on_transition(
        self, old: sm.State, new: sm.State, event: sm.Event, decision: sm.Decision
    ) -> None: ...

    def on_launch(self, attempt: Attempt) -> None: ...

    def on_stopped(self, attempt: Attempt) -> None: ...


class Audience:
    """The observers, told in order; what they heard is kept for the one that attaches
    late (the metrics: created after the first launch so that their imports do not delay
    it) until it attaches, and never when none is coming."""

    def __init__(self, observers: Sequence[Observer], *, late: bool) -> None:
        self.observers = list(observers)
        self._heard: list[Callable[[Observer], None]] | None = [] if late else None

    def tell(self, heard: Callable[[Observer], None]) -> None:
        for observer in self.observers:
            heard(observer)
        if self._heard is not None:
            self._heard.append(heard)

    def attach(self, observer: Observer) -> None:
        """From now on (before the first launch: the watchdog's and health signals')."""
        self.observers.append(observer)

    def attach_late(self, observer: Observer) -> None:
        for heard in self._heard or ():
            heard(observer)
        self._heard = None
        self.observers.append(observer)


def restart_policy(settings: Settings) -> RestartPolicy:
    """The restart budget and backoff the flags ask for."""
    base, top = settings.backoff
    return RestartPolicy(
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


class Controller:
    """Owns the state machine and the live worker group."""

    def __init__(
        self,
        settings: Settings,
        rendezvous: Rendezvous,
        *,
        group: WorkerGroup,
        view: ReadModel,
        policy: RestartPolicy,
        events: EventLog,
        output: OutputPlan,
        progress: ProgressTable,
        observers: Sequence[Observer] = (),
        stop_guard: StopGuard | None = None,
        healing: Healing | None = None,
        late_observer: bool = False,
    ) -> None:
        self.settings = settings
        self.rendezvous = rendezvous
        self.group = group
        self.view = view
        self.policy = policy
        self.events = events
        self.output = output
        self.progress = progress
        # the read model first: its event-log lines precede those of other observers
        # (and the metrics, attached late, hear what came before them: --no-health has none)
        self.audience = Audience([view, *observers], late=late_observer)
        self.stop_guard = stop_guard
        self.healing = healing  # node checks, root causes, quarantine (supervisor.healing)
        self.started = time.monotonic()
        self.state = sm.State()
        self.round: RendezvousResult | None = None
        self._action = anyio.CancelScope()
        self._tg: TaskGroup | None = None
        self._send: Outbox | None = None
        self._rng = random.Random()
        self._launched_once = anyio.Event()
        self.membership = MembershipWatch(rendezvous, events, self._post)

    @property
    def attempt(self) -> Attempt | None:
        """The current (or last) attempt of the worker group."""
        return self.group.attempt

    # ------------------------------------------------------------------ main loop
    async def run(self, inbox: Inbox, outbox: Outbox) -> RunResult:
        """Run until a final state; return how it ended (the exit code and root cause)."""
        self._send = outbox
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                self.view.publish()
                self._execute(sm.StartRendezvous())
                async for item in inbox:
                    self._handle(item)
                    if self.state.phase.final:
                        break
                tg.cancel_scope.cancel()
        finally:
            await self.group.release()
            self.group.close()
        self.view.summarise()
        return self.view.result()

    def attach(self, observer: Observer) -> None:
        """Add an observer of the transitions from now on (started before the first
        launch: the watchdog's and health signals' tables)."""
        self.audience.attach(observer)

    def attach_late(self, observer: Observer) -> None:
        """Add an observer and replay to it all that observers heard so far."""
        self.audience.attach_late(observer)

    @property
    def launched(self) -> anyio.Event:
        """Set once the first worker group has been launched (for READY=1)."""
        return self._launched_once

    def _post(self, item: InboxItem) -> None:
        assert self._send is not None
        self._send.send_nowait(item)

    def _handle(self, item: InboxItem) -> None:
        match item:
            case ForwardSignal() | ReopenLogs():
                self._command(item)
            case RoundFormed():
                self._apply(item.event, formed=item.result)
            case _:
                self._apply(item)

    def _apply(self, event: sm.Event, formed: RendezvousResult | None = None) -> None:
        """One step of the state machine: the only writer of ``state`` (and, through
        ``_label_events``, of the attempt the event log labels its lines with)."""
        old = self.state
        step = self._transition(old, event)
        if step is None:
            return
        new, decision = step
        self.state = new
        if formed is not None:  # the round this transition accepted: shown from now on
            self.round = formed
            self.view.on_round(formed)
        self._label_events(new.attempt)
        self.audience.tell(lambda observer: observer.on_transition(old, new, event, decision))
        self.view.publish()
        self._execute(decision)

    def _transition(self, old: sm.State, event: sm.Event
                    ) -> tuple[sm.State, sm.Decision] | None:
        """The state machine's answer to ``event``; None for an event that changes
        nothing: an earlier attempt's (counted and dropped) or one with no edge."""
        if sm.is_stale(old, event):  # an earlier attempt's: it can change nothing now
            self.view.on_stale(event)
            return None
        try:
            return sm.transition(old, event, self.policy)
        except sm.InvalidTransition as exc:
            # a bug of ours, never the workers': say so loudly and keep supervising
            # (raising here would end the run and orphan the group's stop)
            logger.error("ignoring an event the state machine has no edge for: %s (%r)",
                         exc, event)
            self.events.emit("invalid_transition", phase=old.phase.value,
                             event=type(event).__name__)
            return None

    def _label_events(self, number: int) -> None:
        """Event-log lines from now on carry attempt ``number`` (as users see it)."""
        self.events.attempt = self.group.shown_attempt(number)

    def _command(self, command: Command) -> None:
        if isinstance(command, ForwardSignal):
            workers = self.attempt.workers if self.attempt else []
            logger.info("forwarding %s to %d workers", signame(command.signum), len(workers))
            signal_workers(workers, command.signum)
            self.events.emit("signal_forwarded", signal=signame(command.signum))
        else:
            assert self._tg is not None
            self._tg.start_soon(self._reopen_logs)

    async def _reopen_logs(self) -> None:
        """SIGHUP: the event log and the rank logs are opened again, off the event loop
        (a worker can plant a FIFO at their paths; ``safepaths`` refuses it)."""
        logger.info("reopening log files")
        await self.events.reopen()
        await self.output.reopen()
        self.events.emit("logs_reopened")
        logger.info("log files reopened")

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
        duration = time.monotonic() - started
        result = msgspec.structs.replace(result, duration=duration)
        job_restarts = await self._job_restarts()
        self._emit_round(result, duration)
        await self.group.settle()  # a fork server about to be ready beats a cold start
        self._post(RoundFormed(result, sm.RendezvousComplete(
            result.round, result.world_size, job_restarts)))

    def _emit_round(self, result: RendezvousResult, duration: float) -> None:
        self.events.emit(
            "rendezvous", round=result.round, group_rank=result.group_rank,
            group_world_size=result.group_world_size, world_size=result.world_size,
            master_addr=result.master_addr, master_port=result.master_port,
            members=list(result.members), duration=round(duration, 6),
        )

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
        else:
            self.events.emit("prepare_retry_scheduled", delay=round(decision.delay, 6),
                             reason=decision.reason)
            logger.warning("preparing the attempt again: %s", decision.reason)

        self._start_action(functools.partial(self._wait_backoff, decision))

    async def _wait_backoff(self, decision: sm.StartBackoff) -> None:
        try:  # count it job-wide first, so every node sees the same budget
            if decision.counted:
                await self.rendezvous.record_failure_restart(decision.reason)
                # said once it is on its way: when the rendezvous is gone (a c10d host
                # lost), the next line is the run's end, not a restart that never comes
                logger.warning("restarting the worker group: %s", decision.reason)
        except RendezvousError as exc:
            logger.info("cannot record the restart job-wide: %s", exc)
        await anyio.sleep(decision.delay)
        self._post(sm.BackoffElapsed())

    # ------------------------------------------------------------------ the group
    def _launch(self, decision: sm.LaunchGroup) -> None:
        assert self.round is not None and self._tg is not None
        self.progress.reset(decision.attempt)
        try:
            attempt = self.group.begin(decision.attempt, decision.restart_count, self.round)
        except AttemptPrepError as exc:
            self._label_events(decision.attempt)  # its lines are the new attempt's
            self._launch_failed(decision, exc)
            return
        self._label_events(decision.attempt)  # after begin: a taken K was skipped
        # its ranks start in a task: the loop serves /healthz and the FIFO between two
        self._tg.start_soon(self._start_group, decision, attempt)

    def _launch_failed(self, decision: sm.LaunchGroup, exc: AttemptPrepError) -> None:
        logger.error("%s (the supervisor's failure, not the workers': no restart is used)", exc)
        self.events.emit("attempt_prepare_failed", message=str(exc))
        self._post(sm.LaunchFailed(decision.attempt, str(exc), time.monotonic()))

    async def _start_group(self, decision: sm.LaunchGroup, attempt: Attempt) -> None:
        group = self.group
        assert self._tg is not None
        try:
            failed_to_start = await group.start(attempt)
        except AttemptPrepError as exc:
            self._launch_failed(decision, exc)
            return
        self._tg.start_soon(group.supervise, attempt, self.membership.watch, self._watch_node)
        self._emit_group_started(decision, attempt)
        self.audience.tell(lambda observer: observer.on_launch(attempt))
        # reported through the inbox like any event: behind whatever was queued before
        # (a shutdown request then meets the launch in STOPPING, an edge of its own)
        now = time.monotonic()
        # every rank, unless a stop decided meanwhile left some unstarted
        ranks = {w.local_rank for w in attempt.workers} | {r for r, _ in failed_to_start}
        self._post(sm.GroupLaunched(decision.attempt, frozenset(ranks), now))
        for local_rank, message in failed_to_start:
            self._post(sm.WorkerFailedToStart(decision.attempt, local_rank, message, now))
        self._launched_once.set()

    def _emit_group_started(self, decision: sm.LaunchGroup, attempt: Attempt) -> None:
        layout = attempt.layout
        self.events.emit(
            "group_started", restart_count=decision.restart_count, dir=str(attempt.directory),
            pids={w.local_rank: w.pid for w in attempt.workers},
            warm=[w.local_rank for w in attempt.workers if w.start.warm] or None,
            master_addr=layout.master_addr, master_port=layout.master_port,
            cpus={w.local_rank: list(w.spec.cpus) for w in attempt.workers if w.spec.cpus}
            or None,
        )

    async def _watch_node(self, attempt: Attempt) -> None:
        """The node check every interval while this attempt runs."""
        if self.healing is not None:
            self._post(await self.healing.watch())

    def _stop(self, decision: sm.StopGroup) -> None:
        if decision.reason in (sm.StopReason.SHUTDOWN, sm.StopReason.FATAL):
            self._action.cancel()  # no more rendezvous, backoff or barrier
        attempt = self.attempt
        self.group.stopping(attempt)  # no standby is planned for it from now on
        root = self.state.root_cause
        self.events.emit(
            "group_stopping", reason=decision.reason.value, signal=signame(decision.signum),
            root_cause=root.describe() if root else None,
        )
        if root is not None and decision.reason is sm.StopReason.FAILURE:
            logger.error("worker group failed: %s", root.describe())
        # a failure's verdict is resolved beside the stop, for the failure decided now
        failure = root if decision.reason is sm.StopReason.FAILURE else None
        assert self._tg is not None
        self._tg.start_soon(self._stop_attempt, attempt, decision, failure, self.round)

    async def _stop_attempt(self, attempt: Attempt | None, decision: sm.StopGroup,
                            failure: sm.Failure | None, round_: RendezvousResult | None
                            ) -> None:
        """Stop the workers and report it; a failure's verdict is posted first, as an
        event of its own: the transition it meets decides where the stop leads."""
        started = time.monotonic()
        guard = (
            self.stop_guard()
            if self.stop_guard is not None and decision.reason is sm.StopReason.SHUTDOWN
            else nullcontext()
        )
        async with guard:
            verdict = await self._stop_and_resolve(attempt, decision, failure, round_)
        if verdict is not None:  # before GroupStopped: it decides where the stop leads
            self._post(verdict)
        self.events.emit("group_stopped", seconds=round(time.monotonic() - started, 6))
        self._post(sm.GroupStopped(time.monotonic(), self._rng.random()))

    async def _stop_and_resolve(self, attempt: Attempt | None, decision: sm.StopGroup,
                                failure: sm.Failure | None, round_: RendezvousResult | None
                                ) -> sm.Event | None:
        """Stop the workers; meanwhile, for a failure, ask whether it came from a lost
        peer (a membership change), was another node's (a remote consequence) or the K-th
        of this node's (quarantine). Returns the verdict's event; changes nothing."""
        if failure is None:
            await self._stop_workers(attempt, decision)
            return None
        verdict = list[sm.Event | None]()

        async def resolve() -> None:
            verdict.append(await self._resolve(failure, attempt, round_))

        async with anyio.create_task_group() as tg:
            tg.start_soon(resolve)
            await self._stop_workers(attempt, decision)
        return verdict[0] if verdict else None

    async def _resolve(self, root: sm.Failure, attempt: Attempt | None,
                       round_: RendezvousResult | None) -> sm.Event | None:
        """A lost peer first: its consequence is no failure of this node's to record."""
        lost = await self._lost_peers(root, round_)
        if lost is not None or self.healing is None:
            return lost
        number = round_.round if round_ else 0
        rank = None if root.local_rank is None or attempt is None else (
            attempt.layout.rank_offset + root.local_rank)
        return await self.healing.resolve(root, number, rank)

    async def _lost_peers(self, root: sm.Failure, round_: RendezvousResult | None
                          ) -> sm.PeerLost | None:
        """Ask the round's other members (``Rendezvous.check_peers``, bounded by
        ``CHECK_BOUND``) whether one is gone, for a failure a lost peer can cause."""
        if (root.kind not in PEER_KINDS or round_ is None or len(round_.members) < 2
                or not self.rendezvous.capabilities.membership_can_change):
            return None
        started = time.monotonic()
        check = await self.rendezvous.check_peers(round_, CHECK_BOUND)
        self.events.emit("peers_checked", round=round_.round,
                         lost={p.node: p.how for p in check.lost} or None,
                         alive=list(check.alive), unsure=list(check.unsure) or None,
                         seconds=round(time.monotonic() - started, 6))
        if not check.lost:
            if check.unsure:
                logger.info("no peer confirmed gone (no clear answer from %s within %g s): "
                            "the failure counts as this node's", ", ".join(check.unsure),
                            CHECK_BOUND)
            return None
        return sm.PeerLost(check.lost, time.monotonic())

    async def _stop_workers(self, attempt: Attempt | None, decision: sm.StopGroup) -> None:
        await self.group.stop(attempt, decision.signum)
        if attempt is not None and attempt.workers:
            self.audience.tell(lambda observer: observer.on_stopped(attempt))

    # ------------------------------------------------------------------ the end
    def _finish(self, decision: sm.Exit) -> None:
        self._action.cancel()
        root = self.state.root_cause
        self.events.emit(
            "finished", phase=self.state.phase.value, exit_code=decision.code,
            reason=decision.reason, restart_count=self.state.restart_count,
            root_cause=root.describe() if root else None,
        )

    # ------------------------------------------------------------------ snapshots
    def live_worker_ranks(self) -> dict[int, int]:
        """{pid: local rank} of the current attempt's workers that have not exited.

        Empty unless the group runs or its ranks are being started (a rank that started
        first may post before the last one has): deadlines posted while a group is
        stopping or before it started are not progress and must not be enforced.
        """
        attempt = self.attempt
        if attempt is None or self.state.phase not in (sm.Phase.RUNNING, sm.Phase.STARTING):
            return {}
        return {w.pid: w.local_rank for w in attempt.workers if w.status is None}
