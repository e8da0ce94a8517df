"""The read model: the one builder and publisher of status views, and the end-of-run summary.

``ReadModel`` is an observer of the controller: from each transition (and the rendezvous
round a transition accepted) it writes the transition's event-log lines, builds the
immutable ``StatusView`` (``/status``, ``/healthz``, ``/readyz``, systemd's STATUS line, the
job-wide status in etcd all read it) and publishes it in the ``StatusHub``. Anything else that
changes what a reader sees (goodput progress, an etcd outage) asks it to ``publish``
again. It never changes supervisor state; the controller never builds a view.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import anyio
import msgspec

from supervisor.config import Settings
from supervisor.core import state as sm
from supervisor.core.goodput import Ledger
from supervisor.core.policy import RestartPolicy
from supervisor.core.statusview import FailureView, RendezvousView, StatusView, WorkerView
from supervisor.events import EventLog
from supervisor.rendezvous.base import RendezvousResult
from supervisor.workers.group import Attempt, WorkerFailure, WorkerGroup
from supervisor.workers.output import OutputPlan
from supervisor.workers.spawn import Worker

# the name the transition and end-of-run lines always had (users' log filters know it)
logger = logging.getLogger("supervisor.controller")


class StatusHub:
    """Holds the latest published ``StatusView``; readers wait for changes without polling."""

    def __init__(self, first: StatusView) -> None:
        self.current = first
        self.version = 0
        self._changed = anyio.Event()

    def publish(self, view: StatusView) -> None:
        self.current = view
        self.version += 1
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_changed(self, seen: int) -> int:
        while self.version == seen:
            await self._changed.wait()
        return self.version


class GoodputView(Protocol):
    """The goodput accountant as the read model sees it."""

    def ledger(self) -> Ledger: ...

    def summary_line(self) -> str: ...


class NodeHealthView(Protocol):
    """Healing as the read model sees it (``supervisor.healing.Healing``)."""

    @property
    def enabled(self) -> bool: ...

    def view(self) -> dict[str, Any]: ...

    def status_line(self) -> str | None: ...


class RunResult(msgspec.Struct, frozen=True):
    """How a run ended: the exit code (0, the root cause's, 2, 73, 128+N) and why."""

    exit_code: int
    root_cause: str = ""  # the root cause's description ("" when there is none)
    failures: tuple[WorkerFailure, ...] = ()  # the last attempt's, in the order observed
    attempt_started: bool = False  # whether any worker group was launched


class ReadModel:
    """Builds every view of the run from the controller's transitions; publishes them."""

    def __init__(
        self,
        settings: Settings,
        *,
        run_id: str,
        backend: str,
        group: WorkerGroup,
        policy: RestartPolicy,
        events: EventLog,
        output: OutputPlan,
        timer_file: str | None,
        health_port: int | None,
        goodput: GoodputView | None = None,
        service_status: Callable[[], dict[str, Any]] | None = None,
        members_checked: bool = True,
        node_health: NodeHealthView | None = None,
        snapshots: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.settings = settings
        self.run_id = run_id
        self.backend = backend
        self.group = group
        self.policy = policy
        self.events = events
        self.output = output
        self.timer_file = timer_file
        self.health_port = health_port  # the port used: differs from the default if busy
        self.goodput = goodput
        self.service_status = service_status
        self.members_checked = members_checked  # whether success was checked job-wide
        self.node_health = node_health
        self.snapshots = snapshots  # the snapshot memory's status (supervisor.snapshots)
        self.state = sm.State()
        self.round: RendezvousResult | None = None
        self.stale_events = 0  # earlier attempts' events dropped so far
        self._started_wall = time.time()
        self.hub = StatusHub(self.status_view())

    # ------------------------------------------------------------------ inputs
    def on_transition(
        self, old: sm.State, new: sm.State, event: sm.Event, decision: sm.Decision
    ) -> None:
        """Write the step's event-log lines and publish the new state."""
        self._record(event)
        self.state = new  # the event log already labels its lines with new.attempt
        if new.phase is not old.phase:
            logger.info("%s -> %s (%s)", old.phase.value, new.phase.value, type(event).__name__)
            self.events.emit(
                "state", old=old.phase.value, new=new.phase.value, cause=type(event).__name__,
                reason=(new.stop_reason.value if new.stop_reason else None),
            )
        if isinstance(event, sm.PeerLost) and old.stop_reason is sm.StopReason.FAILURE:
            self._peer_lost(event, new)
        if new.phase is sm.Phase.FAILED and old.stop_reason is sm.StopReason.FAILURE:
            self.events.emit("restart_refused", reason=new.last_decision_reason,
                             restart_count=new.restart_count)

    def on_launch(self, attempt: Attempt) -> None:
        return None

    def on_stopped(self, attempt: Attempt) -> None:
        return None

    def on_stale(self, event: sm.Event) -> None:
        """An earlier attempt's event, dropped: logged and counted (``stale_events`` in
        ``/status``, ``elastic_supervisor_stale_events_dropped_total`` in ``/metrics``)."""
        self.stale_events += 1
        logger.debug("dropping stale %s", event)
        attempt = event.attempt if isinstance(event, sm.AttemptEvent) else None
        self.events.emit("stale_event_dropped", dropped=type(event).__name__,
                         of_attempt=None if attempt is None else self.group.shown_attempt(attempt),
                         count=self.stale_events)
        self.publish()  # /status and /metrics show the count

    def on_round(self, result: RendezvousResult) -> None:
        """The round a transition just accepted (members, master: shown in ``/status``);
        called by the controller within that transition, before ``on_transition``."""
        self.round = result

    def _peer_lost(self, event: sm.PeerLost, new: sm.State) -> None:
        """Which peers were lost, how each was seen, and what it cost."""
        free = new.stop_reason is sm.StopReason.MEMBERSHIP
        self.events.emit("peer_lost", nodes={p.node: p.how for p in event.lost},
                         budget_used=not free)
        logger.log(logging.WARNING if free else logging.ERROR, "%s",
                   new.last_decision_reason)

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

    # ------------------------------------------------------------------ the view
    def publish(self) -> None:
        self.hub.publish(self.status_view())

    def status_view(self) -> StatusView:
        s = self.state
        attempt = self.group.attempt
        workers: tuple[WorkerView, ...] = ()
        if attempt is not None:
            workers = tuple(_worker_view(w, s.phase) for w in attempt.workers)
        rnd = self.round
        return StatusView(
            run_id=self.run_id,
            phase=s.phase.value,
            attempt=self.group.shown_attempt(s.attempt),
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
                backend=self.backend,
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
            node_health=(self.node_health.view() if self.node_health is not None
                         and self.node_health.enabled else None),
            stale_events=self.stale_events,
            snapshots=self.snapshots() if self.snapshots is not None else None,
        )

    def status_line(self) -> str:
        s = self.state
        n = self.settings.local_world_size
        up = len(s.running) if s.phase is sm.Phase.RUNNING else 0
        budget = f"restarts {s.restart_count}/{self.settings.max_restarts}"
        shown = self.group.shown_attempt(s.attempt)
        line = f"{s.phase.value} attempt {shown}: {up}/{n} workers, {budget}"
        health = self.node_health.status_line() if self.node_health is not None else None
        if health is not None and s.phase is sm.Phase.RENDEZVOUS:  # spare, held, failing
            line = f"{health}, {budget}"
        # the port actually used: it differs from the default when that one was busy
        return line if self.health_port is None else f"{line}, health port {self.health_port}"

    def _failure_view(self, failure: sm.Failure | None) -> FailureView | None:
        if failure is None:
            return None
        attempt = self.group.attempt
        offset = attempt.layout.rank_offset if attempt else 0
        error_file = None
        if failure.local_rank is not None:
            path = (self.group.attempt_dir(failure.attempt) / str(failure.local_rank)
                    / "error.json")
            error_file = str(path) if path.is_file() else None  # only a file that exists
        return FailureView(
            kind=failure.kind.value,
            attempt=self.group.shown_attempt(failure.attempt),
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

    # ------------------------------------------------------------------ the end
    def result(self) -> RunResult:
        """The typed outcome of the run (what ``supervise`` returns)."""
        s = self.state
        root = s.root_cause
        attempt = self.group.attempt
        return RunResult(
            exit_code=s.exit_code if s.exit_code is not None else 1,
            root_cause=root.describe() if root else "",
            failures=tuple(attempt.failures) if attempt is not None else (),
            attempt_started=attempt is not None,
        )

    def summarise(self) -> None:
        """The end-of-run log lines: losses, goodput, and the failure summary."""
        self._summarise_losses()
        s = self.state
        if self.goodput is not None:
            logger.info("%s", self.goodput.summary_line())
        if s.phase is sm.Phase.SUCCEEDED:
            logger.info("job succeeded after %d restart(s)%s", s.restart_count,
                        "" if self.members_checked else
                        " on this node (static backend: the other nodes were not checked)")
            return
        if s.phase is sm.Phase.STOPPED:
            # asked to stop (SIGTERM, systemctl stop): a clean end, not an error to alert on
            logger.info("job stopped (exit code %s): %s", s.exit_code, s.last_decision_reason)
            return
        logger.error("job %s (exit code %s): %s", s.phase.value, s.exit_code,
                     s.last_decision_reason)
        failure = s.root_cause or s.last_failure
        attempt = self.group.attempt
        if failure is None or attempt is None:
            return
        lines = ["failure summary:", f"  root cause: {failure.describe()}"]
        if failure.local_rank is not None:
            rank = attempt.layout.rank_offset + failure.local_rank
            shown = self.group.shown_attempt(failure.attempt)
            lines.append(f"  rank {rank} (local {failure.local_rank}), attempt {shown}")
            lines.extend(f"  {line}" for line in self._rank_files(failure))
        for worker in attempt.workers:
            st = worker.status
            outcome = (
                "running" if st is None
                else f"exit {st.exit_code}" if st.exit_code is not None
                else f"signal {signame(st.signal or 0)}"
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
        rank_dir = self.group.attempt_dir(failure.attempt) / str(failure.local_rank)
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


def signame(signum: int | None) -> str:
    return sm.signal_name(signum) if signum else ""
