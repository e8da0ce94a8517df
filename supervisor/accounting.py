"""Feeds the pure goodput accountant (``core.goodput``) and reports what it closes.

A controller ``Observer``: each state-machine step becomes an accountant input (launch,
failure with its cause, group stopped, pause, end), stamped with the times the events
carry. The ``ProgressTable``'s listener brings each rank's first progress per attempt.
Every failure record the accountant closes becomes one ``recovered`` line in
``events.jsonl`` and, once the metrics exist, one observation of the recovery-time
histogram. ``run`` settles a wait for progress whose bound passed while nothing else
happened.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import anyio
from anyio.abc import TaskStatus

from supervisor.core import state as sm
from supervisor.core.goodput import (
    Accountant,
    Ledger,
    Outcome,
    Recovery,
    cause_of_membership,
    totals,
)
from supervisor.core.health import recovery_json
from supervisor.core.statusview import ProgressTable
from supervisor.events import EventLog

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
MAX_KEPT = 1000  # records closed before the metrics attach (the first ~0.5 s), kept for them
MAX_MESSAGE = 500  # characters of a failure's description kept in its record


class RecoveryMetrics(Protocol):
    """Where closed failure records are counted (``health.metrics.Metrics``)."""

    def record_recovery(self, cause: str, seconds: float, recovered: bool) -> None: ...


class GoodputRecorder:
    """The accountant's one writer, fed by controller transitions and first progress."""

    def __init__(
        self,
        events: EventLog,
        progress: ProgressTable,
        *,
        started: float,
        bound: float,
        clock: Clock = time.monotonic,
        wall: Clock = time.time,
        republish: Callable[[], None] = lambda: None,
        shown: Callable[[int], int] = lambda attempt: attempt,
    ) -> None:
        self.accountant = Accountant(started, bound)
        self.events = events
        self.progress = progress
        self.closed: list[Recovery] = []
        self.metrics: RecoveryMetrics | None = None
        self.republish = republish  # the read model's publish: the ledger changed
        # the state machine's attempt -> the number users see (K of attempt_K), so that
        # records, events and /status carry the one attempt number (group.shown_attempt)
        self.shown = shown
        self._clock = clock
        self._wall = wall
        self._changed = anyio.Event()
        self._suggested = False  # the line on how to give a progress signal was logged
        progress.listeners.append(self.on_progress)

    def ledger(self) -> Ledger:
        """The accountant's current state (goes into every published snapshot)."""
        return self.accountant.ledger()

    def attach_metrics(self, metrics: RecoveryMetrics) -> None:
        """Count every record closed so far, then each one as it closes."""
        for record in self.closed:
            if record.outcome is not Outcome.UNKNOWN:
                _observe(metrics, record)
        self.closed = []
        self.metrics = metrics

    # ------------------------------------------------------------------ inputs
    def on_restored(self, step: int, newest: int | None, saved_at: float | None,
                    source: str) -> None:
        """Snapshots: the attempt about to launch restores ``step`` (its failure record
        says so)."""
        self.accountant.restored(step, newest, saved_at, source)
        self.republish()

    def on_progress(self, attempt: int, local_rank: int, at: float) -> None:
        """A rank's first progress in an attempt (ProgressTable listener)."""
        closed = self.accountant.progress(self.shown(attempt), local_rank, at)
        if closed or not self.accountant.ledger().awaiting:
            self._report(closed)
            self.republish()

    def on_transition(
        self, old: sm.State, new: sm.State, event: sm.Event, decision: sm.Decision
    ) -> None:
        """Turn one state-machine step into accountant inputs."""
        acc = self.accountant
        now = self._clock()
        closed: list[Recovery] = []
        acc.counted(new.restart_count)
        if isinstance(event, sm.GroupLaunched):
            closed += acc.launched(self.shown(event.attempt), event.local_ranks, event.at)
            self._suggest_a_signal()
        elif isinstance(event, sm.GroupStopped):
            acc.stopped(event.at)
        if old.phase is sm.Phase.RUNNING and new.phase is sm.Phase.STOPPING:
            closed += self._stopping(new, event, now)
        elif isinstance(event, sm.RemoteFailure | sm.NodeQuarantined) and (
            new.phase is sm.Phase.STOPPING
        ):  # learned while stopping: what the failure really was
            cause = "remote_failure" if isinstance(event, sm.RemoteFailure) else (
                "node_quarantined")
            acc.relabel(cause, event.message[:MAX_MESSAGE])
        elif isinstance(event, sm.PeerLost) and new.root_cause is not None and (
            new.root_cause.kind is sm.FailureKind.NODE_LOST
        ):  # a peer was lost: a membership change (not past the cap)
            acc.relabel("node_lost", new.root_cause.describe()[:MAX_MESSAGE])
        elif old.phase is sm.Phase.RUNNING and new.phase is sm.Phase.EXIT_BARRIER:
            closed += acc.paused(now, settle=True)
        if new.phase.final:
            closed += acc.finished(now)
        self._report(closed)

    def _suggest_a_signal(self) -> None:
        """Once, at the first relaunch after a failure of a run where no rank has shown
        progress: how to give the supervisor a progress signal (not for a node that
        joined: a forming job restarts as its nodes come)."""
        ledger = self.accountant.ledger()
        last = ledger.last
        if (self._suggested or ledger.seen or last is None
                or last.cause in ("node_joined", "spare_admitted")):
            return
        self._suggested = True
        logger.warning("no rank has a progress signal, so what this restart costs, goodput "
                       "and readiness cannot be known: give --progress-pattern REGEX (a line "
                       "the script prints every step), post deadlines (FileTimerClient), or "
                       "save snapshots (supervisor.snapshot.save, docs/snapshots.md)")

    def on_launch(self, attempt: object) -> None:
        """Observer hook; the launch is taken from its GroupLaunched event."""

    def on_stopped(self, attempt: object) -> None:
        """Observer hook; the stop is taken from its GroupStopped event."""

    def _stopping(self, new: sm.State, event: sm.Event, now: float) -> list[Recovery]:
        acc = self.accountant
        if new.stop_reason is sm.StopReason.SHUTDOWN:
            return acc.paused(now, settle=False)
        root = new.root_cause
        if root is not None:
            last = None
            if root.local_rank is not None and root.kind in (
                sm.FailureKind.DEADLINE, sm.FailureKind.UNHEALTHY
            ):
                last = self.progress.last_progress(root.local_rank)
            return acc.failed(
                _cause(root), root.at, local_rank=root.local_rank, last_progress=last,
                message=root.describe()[:MAX_MESSAGE],
            )
        reason = event.reason if isinstance(event, sm.MembershipChanged) else ""
        return acc.failed(cause_of_membership(reason), now, message=reason[:MAX_MESSAGE])

    # ------------------------------------------------------------------ outputs
    def _report(self, closed: list[Recovery]) -> None:
        for record in closed:
            doc = recovery_json(record, self._clock(), self._wall())
            assert doc is not None
            doc.pop("number")
            doc["failed_attempt"] = doc.pop("attempt")  # the line's own "attempt" is current
            self.events.emit("recovered", failure=record.number, recovered=_recovered(record),
                             **doc)
            if record.outcome is Outcome.UNKNOWN:
                logger.info("failure %d (%s, attempt %d): relaunched; lost unknown (no "
                            "progress signal), at least %.3f s until the relaunch",
                            record.number, record.cause, record.attempt,
                            record.lost_at_least or 0.0)
            else:
                level = logging.INFO if record.outcome is Outcome.RECOVERED else logging.WARNING
                logger.log(level, "failure %d (%s, attempt %d): %s after %.3f s lost",
                           record.number, record.cause, record.attempt, record.outcome.value,
                           record.lost or 0.0)
            if record.outcome is Outcome.UNKNOWN:
                pass  # no figure to observe: the recovery time was not seen
            elif self.metrics is not None:
                _observe(self.metrics, record)
            elif len(self.closed) < MAX_KEPT:  # kept only until the metrics exist
                self.closed.append(record)
        self._changed.set()
        self._changed = anyio.Event()

    def summary_line(self) -> str:
        """The end-of-job line: wall, productive, lost by cause, ratio."""
        t = totals(self.ledger(), self._clock())
        counts = f"{t.failures} failure(s), {t.restarts} restart(s)"
        if not t.seen:  # no signal: nothing says when (or whether) work was done
            return (f"goodput: wall {t.wall:.1f}s, idle {t.idle:.1f}s, {counts}; start-up, "
                    "productive and lost time unknown, effective training time unknown (no "
                    "rank had a progress signal: see --progress-pattern)")
        causes = ", ".join(f"{k} {v:.1f}s" for k, v in t.lost_by_cause.items() if v > 0)
        ratio = "-" if t.ratio is None else f"{100 * t.ratio:.1f}%"
        if t.unknown > 0:  # a signal came late: the time before it is not seen
            ratio = "unknown (no rank had a progress signal for part of the run)"
        unknown = f", unknown {t.unknown:.1f}s" if t.unknown > 0 else ""
        return (
            f"goodput: wall {t.wall:.1f}s, start-up {t.startup:.1f}s, productive "
            f"{t.productive:.1f}s, lost {t.lost:.1f}s ({causes or 'none'}), idle "
            f"{t.idle:.1f}s{unknown}, {counts}, effective training time {ratio}"
        )

    # ------------------------------------------------------------------ the bound
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Settle a wait for progress when its bound passes with no other input."""
        task_status.started()
        while True:
            changed = self._changed
            deadline = self.accountant.deadline()
            if deadline is None:
                await changed.wait()
                continue
            with anyio.move_on_after(max(0.0, deadline - self._clock())):
                await changed.wait()
            if self.accountant.deadline() == deadline:
                self.settle_due()

    def settle_due(self) -> None:
        """Settle a wait for progress whose bound has passed by now (``run`` calls it)."""
        deadline = self.accountant.deadline()
        if deadline is not None and self._clock() >= deadline:
            self._report(self.accountant.poll(self._clock()))
            self.republish()


def _cause(failure: sm.Failure) -> str:
    match failure.kind:
        case sm.FailureKind.EXITED:
            return "exit_code"
        case sm.FailureKind.SIGNALED:
            return "signal"
        case sm.FailureKind.DEADLINE:
            return "hang"
        case sm.FailureKind.UNHEALTHY:
            return "dstate"
        case sm.FailureKind.REMOTE:
            return "remote_failure"
        case sm.FailureKind.NODE_CHECK:
            return "node_check"
        case sm.FailureKind.NODE_LOST:
            return "node_lost"
    return "other"


def _recovered(record: Recovery) -> bool | str:
    """The ``recovered`` event's flag: "unknown" when the resumption could not be seen."""
    if record.outcome is Outcome.UNKNOWN:
        return "unknown"
    return record.outcome is Outcome.RECOVERED


def _observe(metrics: RecoveryMetrics, record: Recovery) -> None:
    metrics.record_recovery(record.cause, record.lost or 0.0,
                            record.outcome is Outcome.RECOVERED)
