"""The recorder that feeds the accountant, driven by the real state machine's steps.

No processes: each scripted event goes through ``core.state.transition`` and the
recorder hears the step exactly as the controller reports it to its observers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.accounting import GoodputRecorder
from supervisor.core import state as sm
from supervisor.core.policy import RestartPolicy
from supervisor.core.statusview import ProgressTable
from supervisor.events import EventLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Run:
    """A state machine, a recorder observing it, and its event log."""

    def __init__(self, tmp_path: Path) -> None:
        self.path = tmp_path / "events.jsonl"
        self.events = EventLog(self.path, "job")
        self.progress = ProgressTable()
        self.clock = Clock()
        self.recorder = GoodputRecorder(self.events, self.progress, started=100.0, bound=60.0,
                                        clock=self.clock, wall=lambda: 1000.0 + self.clock.now)
        self.state = sm.State()
        self.policy = RestartPolicy(max_restarts=3)

    def step(self, event: sm.Event, at: float | None = None) -> None:
        if at is not None:
            self.clock.now = at
        old = self.state
        new, decision = sm.transition(old, event, self.policy)
        self.state = new
        self.recorder.on_transition(old, new, event, decision)

    def launch(self, attempt: int, at: float) -> None:
        self.step(sm.RendezvousComplete(attempt, 2), at)
        self.progress.reset(attempt)
        self.step(sm.GroupLaunched(attempt, frozenset({0, 1}), at), at)

    def restart(self, attempt: int, at: float) -> None:
        self.step(sm.GroupStopped(at), at)
        self.step(sm.BackoffElapsed(), at)
        self.launch(attempt, at)

    def recovered(self) -> list[dict[str, Any]]:
        lines = self.path.read_text().splitlines()
        return [e for e in map(json.loads, lines) if e["event"] == "recovered"]


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    made = Run(tmp_path)
    yield made
    made.events.close()


def test_hang_is_lost_from_the_ranks_last_post(run: Run) -> None:
    run.launch(1, 101.0)
    run.progress.touch(0, 102.0)
    run.progress.touch(1, 102.5)
    run.progress.touch(0, 110.0)  # rank 0's last post
    run.step(sm.DeadlineExpired(1, 0, 42, "step", 0.001, 140.0), 140.0)
    run.restart(2, 141.0)
    run.progress.touch(0, 143.0)
    run.progress.touch(1, 144.0)
    (rec,) = run.recovered()
    assert rec["cause"] == "hang" and rec["local_rank"] == 0
    assert rec["failed_at"] == 1110.0 and rec["resumed_at"] == 1144.0
    assert rec["lost"] == 34.0 and rec["phases"]["detect"] == 30.0


def test_crash_counts_from_the_exit_and_shutdown_pauses(run: Run) -> None:
    run.launch(1, 101.0)
    run.progress.touch(0, 102.0)
    run.progress.touch(1, 103.0)
    run.step(sm.WorkerExited(1, 1, 43, None, 9, 120.0), 120.0)
    run.restart(2, 121.0)
    run.progress.touch_output(0, 122.0)  # rank 0 posts deadlines: a line is not progress
    run.progress.touch(0, 123.0)
    run.progress.touch(1, 124.0)
    (rec,) = run.recovered()
    assert rec["cause"] == "signal" and rec["lost"] == 4.0
    run.step(sm.ShutdownRequested(15), 130.0)
    run.step(sm.GroupStopped(131.0), 131.0)
    assert run.state.phase is sm.Phase.STOPPED
    line = run.recorder.summary_line()
    assert line.startswith("goodput: wall 31.0s, start-up 3.0s, productive 23.0s, lost 4.0s "
                           "(signal 4.0s), idle 1.0s, 1 failure(s), 1 restart(s)")


def test_records_closed_before_the_metrics_attach_are_counted_once(run: Run) -> None:
    seen: list[tuple[str, float, bool]] = []

    class Metrics:
        def record_recovery(self, cause: str, seconds: float, recovered: bool) -> None:
            seen.append((cause, seconds, recovered))

    run.launch(1, 101.0)
    run.step(sm.MembershipChanged("node(s) lost: b"), 105.0)
    run.step(sm.GroupStopped(106.0), 106.0)  # a membership change: straight to rendezvous
    run.launch(2, 106.0)
    run.recorder.on_progress(2, 0, 107.0)  # rank 0 shows progress, rank 1 never does
    run.clock.now = 106.0 + 59.9
    run.recorder.settle_due()
    assert run.recovered() == []
    run.clock.now = 106.0 + 60.0  # the bound passed
    run.recorder.settle_due()
    run.recorder.attach_metrics(Metrics())
    assert seen == [("node_lost", 2.0, True)]
    run.step(sm.WorkerExited(2, 0, 44, 3, None, 200.0), 200.0)
    run.step(sm.GroupStopped(200.5), 200.5)  # restarts left: backoff
    run.step(sm.ShutdownRequested(15), 201.0)  # during the backoff
    run.step(sm.GroupStopped(202.0), 202.0)
    assert run.state.phase is sm.Phase.STOPPED
    assert seen[-1] == ("exit_code", 2.0, False)  # ended with the run, unrecovered
    assert len(seen) == 2
    assert [e["recovered"] for e in run.recovered()] == [True, False]


def test_without_a_signal_the_line_says_unknown_and_one_line_suggests_one(
        run: Run, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 53: no "0.0 %" for a run that cannot be measured; the restart count is the
    budget's; the first restart of such a run (only the first) says how to give a signal."""
    run.launch(1, 101.0)
    run.step(sm.WorkerExited(1, 1, 43, 1, None, 110.0), 110.0)
    run.restart(2, 111.0)
    run.step(sm.WorkerExited(2, 1, 44, 1, None, 120.0), 120.0)
    run.restart(3, 121.0)
    hints = [r for r in caplog.records if "--progress-pattern REGEX" in r.getMessage()]
    assert len(hints) == 1 and "supervisor.snapshot.save" in hints[0].getMessage()
    run.step(sm.ShutdownRequested(15), 130.0)
    run.step(sm.GroupStopped(131.0), 131.0)
    line = run.recorder.summary_line()
    assert line == ("goodput: wall 31.0s, idle 1.0s, 2 failure(s), 2 restart(s); start-up, "
                    "productive and lost time unknown, effective training time unknown (no "
                    "rank had a progress signal: see --progress-pattern)")
    assert run.state.restart_count == 2


def test_a_forming_jobs_join_restart_suggests_nothing(
        run: Run, caplog: pytest.LogCaptureFixture) -> None:
    run.launch(1, 101.0)
    run.step(sm.MembershipChanged("node(s) waiting to join: b", 1), 102.0)
    run.step(sm.GroupStopped(102.5), 102.5)
    run.launch(2, 103.0)
    assert not [r for r in caplog.records if "--progress-pattern REGEX" in r.getMessage()]
