"""The run loop's state machine, driven by scripted event sequences (no event loop)."""

from __future__ import annotations

import signal

import pytest

from supervisor.core import state as sm
from supervisor.core.policy import RestartPolicy

POLICY = RestartPolicy(max_restarts=2)
RANKS = frozenset({0, 1})


def run(events: list[sm.Event], policy: RestartPolicy = POLICY, start: sm.State | None = None
        ) -> tuple[sm.State, list[sm.Decision]]:
    state = start or sm.State()
    decisions = []
    for event in events:
        state, decision = sm.transition(state, event, policy)
        decisions.append(decision)
    return state, decisions


def launched(attempt: int = 1, at: float = 0.0) -> list[sm.Event]:
    return [sm.RendezvousComplete(attempt, 2), sm.GroupLaunched(attempt, RANKS, at)]


def exited(rank: int, code: int | None, attempt: int = 1, at: float = 1.0,
           sig: int | None = None) -> sm.WorkerExited:
    return sm.WorkerExited(attempt, rank, 100 + rank, code, sig, at)


def test_rendezvous_launch_running() -> None:
    state, decisions = run(launched())
    assert state.phase is sm.Phase.RUNNING and state.running == RANKS
    assert decisions[0] == sm.LaunchGroup(attempt=1, restart_count=0)


def test_all_zero_exits_go_through_the_barrier_to_success() -> None:
    state, decisions = run([*launched(), exited(0, 0), exited(1, 0), sm.BarrierDone()])
    assert decisions[2] == sm.Nothing()
    assert isinstance(decisions[3], sm.EnterExitBarrier)
    assert state.phase is sm.Phase.SUCCEEDED
    assert decisions[-1] == sm.Exit(0, state.last_decision_reason)


def test_failure_stops_then_backs_off_then_relaunches_with_count() -> None:
    state, decisions = run([*launched(), exited(1, 3), exited(0, None, sig=15),
                            sm.GroupStopped(2.0), sm.BackoffElapsed(), sm.RendezvousComplete(2, 2)])
    assert decisions[2] == sm.StopGroup(sm.StopReason.FAILURE)
    assert isinstance(decisions[4], sm.StartBackoff)
    assert decisions[-1] == sm.LaunchGroup(attempt=2, restart_count=1)
    assert state.root_cause is None or state.root_cause.local_rank == 1


def test_root_cause_is_first_observed_failure_not_later_ones() -> None:
    state, _ = run([*launched(), exited(1, 3, at=1.0), exited(0, 9, at=1.0001)])
    assert state.root_cause is not None and state.root_cause.local_rank == 1
    assert state.root_cause.exit_code == 3


def test_budget_exhausted_fails_with_root_cause_code() -> None:
    policy = RestartPolicy(max_restarts=0)
    state, decisions = run([*launched(), exited(0, 42), sm.GroupStopped(2.0)], policy)
    assert state.phase is sm.Phase.FAILED
    assert decisions[-1].code == 42  # type: ignore[union-attr]


@pytest.mark.parametrize(("code", "sig", "expected"), [(0, None, 1), (126, None, 1),
                                                       (125, None, 125), (None, 9, 1)])
def test_exit_code_mapping(code: int | None, sig: int | None, expected: int) -> None:
    f = sm.Failure(sm.FailureKind.EXITED, 1, 0.0, 0, 1, exit_code=code, signal=sig)
    assert f.process_exit_code == expected


def test_shutdown_stops_and_exits_128_plus_n() -> None:
    state, decisions = run([*launched(), sm.ShutdownRequested(signal.SIGINT),
                            sm.GroupStopped(1.0)])
    assert decisions[2] == sm.StopGroup(sm.StopReason.SHUTDOWN, signal.SIGINT)
    assert state.phase is sm.Phase.STOPPED and state.exit_code == 128 + signal.SIGINT


def test_second_shutdown_request_kills_now() -> None:
    _, decisions = run([*launched(), sm.ShutdownRequested(15), sm.ShutdownRequested(2)])
    assert isinstance(decisions[-1], sm.KillGroupNow)


def test_shutdown_during_failure_stop_finishes_as_stopped() -> None:
    state, decisions = run([*launched(), exited(0, 1), sm.ShutdownRequested(15),
                            sm.GroupStopped(2.0)])
    assert decisions[3] == sm.Nothing()
    assert state.phase is sm.Phase.STOPPED and state.exit_code == 143


def test_shutdown_during_backoff_stops_without_relaunch() -> None:
    policy = RestartPolicy(max_restarts=3, backoff_base=5, backoff_max=5)
    state, decisions = run([*launched(), exited(0, 1), sm.GroupStopped(2.0),
                            sm.ShutdownRequested(15), sm.GroupStopped(2.1)], policy)
    assert isinstance(decisions[3], sm.StartBackoff)
    assert isinstance(decisions[4], sm.StopGroup)
    assert state.phase is sm.Phase.STOPPED


def test_deadline_expiry_is_a_failure_with_its_message() -> None:
    state, decisions = run([*launched(), sm.DeadlineExpired(1, 0, 100, "step", 0.004, 1.0)])
    assert decisions[-1] == sm.StopGroup(sm.StopReason.FAILURE)
    assert state.root_cause is not None
    assert "deadline 'step' expired 0.004 s ago" in state.root_cause.describe()


def test_membership_change_restarts_without_budget() -> None:
    state, decisions = run([*launched(), sm.MembershipChanged("node joined"),
                            sm.GroupStopped(1.0)], RestartPolicy(max_restarts=0))
    assert decisions[-1] == sm.StartRendezvous()
    assert state.restart_count == 0 and state.phase is sm.Phase.RENDEZVOUS


def test_unhealthy_worker_is_fatal_without_restart() -> None:
    state, _ = run([*launched(), sm.WorkerUnhealthy(1, 0, 100, "D state 61 s", 1.0),
                    sm.GroupStopped(2.0)], RestartPolicy(max_restarts=5))
    assert state.phase is sm.Phase.FAILED and state.exit_code == 1
    assert state.restart_count == 0


def test_impossible_event_raises_named_error() -> None:
    with pytest.raises(sm.InvalidTransition, match="no transition from rendezvous"):
        sm.transition(sm.State(), sm.BackoffElapsed(), POLICY)


def test_rendezvous_failure_ends_the_job() -> None:
    state, decisions = run([sm.RendezvousFailed("etcd unreachable", 0.0)])
    assert state.phase is sm.Phase.FAILED and decisions[0] == sm.Exit(1, state.last_decision_reason)


def test_events_after_the_end_change_nothing() -> None:
    state, _ = run([*launched(), exited(0, 0), exited(1, 0), sm.BarrierDone()])
    again, decision = sm.transition(state, exited(0, 1), POLICY)
    assert again == state and decision == sm.Nothing()


# ---------------------------------------------------------------- supervisor-side failures
def test_attempt_the_supervisor_cannot_prepare_is_retried_without_the_budget() -> None:
    state, decisions = run([sm.RendezvousComplete(1, 2), sm.LaunchFailed(1, "ENOSPC", 1.0)])
    assert state.phase is sm.Phase.BACKOFF
    assert state.restart_count == 0 and state.prepare_failures == 1
    backoff = decisions[-1]
    assert isinstance(backoff, sm.StartBackoff) and not backoff.counted
    assert backoff.delay == sm.prepare_retry_delay(1) == 1.0
    assert state.last_failure is not None
    assert state.last_failure.kind is sm.FailureKind.SUPERVISOR


def test_preparation_retries_back_off_and_then_fail_with_their_own_exit_code() -> None:
    events: list[sm.Event] = []
    for n in range(1, sm.PREPARE_RETRIES + 2):
        events += [sm.RendezvousComplete(n, 2), sm.LaunchFailed(n, "no inodes", float(n))]
        if n <= sm.PREPARE_RETRIES:
            events.append(sm.BackoffElapsed())
    state, decisions = run(events)
    delays = [d.delay for d in decisions if isinstance(d, sm.StartBackoff)]
    assert delays == [min(30.0, 2.0 ** i) for i in range(sm.PREPARE_RETRIES)]
    assert state.phase is sm.Phase.FAILED
    assert state.exit_code == sm.EXIT_PREPARE_FAILED == 73
    assert state.restart_count == 0
    assert state.root_cause is not None and "no inodes" in state.root_cause.describe()


def test_a_launch_that_succeeds_clears_the_preparation_failures() -> None:
    state, _ = run([sm.RendezvousComplete(1, 2), sm.LaunchFailed(1, "ENOSPC", 1.0),
                    sm.BackoffElapsed(), sm.RendezvousComplete(2, 2),
                    sm.GroupLaunched(2, RANKS, 2.0)])
    assert state.phase is sm.Phase.RUNNING and state.prepare_failures == 0
