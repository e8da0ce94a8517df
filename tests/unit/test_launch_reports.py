"""The launch reports through the inbox like every event (GroupLaunched, one
WorkerFailedToStart per rank whose spawn raised, LaunchFailed), behind whatever was queued
first: a shutdown request then meets the launch in STOPPING. Pure: scripted sequences."""

from __future__ import annotations

from supervisor.core import state as sm
from supervisor.core.policy import RestartPolicy

POLICY = RestartPolicy(max_restarts=0)


def _starting() -> sm.State:
    state, decision = sm.transition(sm.State(), sm.RendezvousComplete(1, 2), POLICY)
    assert state.phase is sm.Phase.STARTING and decision == sm.LaunchGroup(1, 0)
    return state


def test_a_shutdown_queued_before_the_launch_stops_the_new_group() -> None:
    state, decision = sm.transition(_starting(), sm.ShutdownRequested(15), POLICY)
    assert decision == sm.StopGroup(sm.StopReason.SHUTDOWN, 15)
    state, decision = sm.transition(state, sm.GroupLaunched(1, frozenset({0, 1}), 1.0), POLICY)
    assert (state.phase, state.attempt, state.running, decision) == (
        sm.Phase.STOPPING, 1, frozenset({0, 1}), sm.Nothing())
    exited = sm.WorkerExited(1, 0, 10, None, 15, 2.0)
    assert not sm.is_stale(state, exited)  # the new group's exits are current
    state, _ = sm.transition(state, exited, POLICY)
    state, decision = sm.transition(state, sm.GroupStopped(3.0), POLICY)
    assert (state.phase, decision) == (sm.Phase.STOPPED, sm.Exit(128 + 15, "stopped by SIGTERM"))


def test_a_shutdown_queued_before_a_failed_preparation_ends_the_run() -> None:
    state, _ = sm.transition(_starting(), sm.ShutdownRequested(15), POLICY)
    state, decision = sm.transition(state, sm.LaunchFailed(1, "disk full", 1.0), POLICY)
    assert (state.phase, decision, state.root_cause) == (sm.Phase.STOPPING, sm.Nothing(), None)
    state, _ = sm.transition(state, sm.GroupStopped(2.0), POLICY)
    assert state.phase is sm.Phase.STOPPED


def test_a_rank_that_cannot_start_fails_like_an_exit_127() -> None:
    running, _ = sm.transition(_starting(), sm.GroupLaunched(1, frozenset({0, 1}), 1.0), POLICY)
    state, decision = sm.transition(running, sm.WorkerFailedToStart(1, 1, "E2BIG", 2.0), POLICY)
    assert decision == sm.StopGroup(sm.StopReason.FAILURE)
    assert state.running == frozenset({0})
    root = state.root_cause
    assert root is not None
    assert (root.kind, root.local_rank, root.exit_code, root.pid) == (
        sm.FailureKind.EXITED, 1, 127, None)
    assert root.describe() == "local rank 1 exited with code 127: E2BIG"
    assert root.process_exit_code == 1
