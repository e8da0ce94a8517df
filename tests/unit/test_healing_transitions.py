"""The state machine's healing edges: remote consequences and quarantine (no event loop)."""

from __future__ import annotations

from supervisor.core import state as sm
from supervisor.core.nodehealth import EXIT_QUARANTINED
from supervisor.core.policy import RestartPolicy

POLICY = RestartPolicy(max_restarts=1)


def run(events: list[sm.Event]) -> tuple[sm.State, list[sm.Decision]]:
    state = sm.State()
    decisions = []
    for event in events:
        state, decision = sm.transition(state, event, POLICY)
        decisions.append(decision)
    return state, decisions


LAUNCHED: list[sm.Event] = [sm.RendezvousComplete(1, 2), sm.GroupLaunched(1, frozenset({0}), 0.0)]
FAILED = sm.WorkerExited(1, 0, 100, 1, None, 1.0)


def test_a_remote_consequence_rejoins_without_using_the_budget() -> None:
    state, decisions = run([*LAUNCHED, FAILED, sm.RemoteFailure("node b failed first", 1.1),
                            sm.GroupStopped(2.0)])
    assert decisions[-1] == sm.StartRendezvous()
    assert state.restart_count == 0 and state.phase is sm.Phase.RENDEZVOUS
    assert state.last_failure is not None
    assert state.last_failure.kind is sm.FailureKind.REMOTE


def test_the_kth_failure_quarantines_instead_of_restarting() -> None:
    state, decisions = run([*LAUNCHED, FAILED, sm.NodeQuarantined("2 failures", 1.1),
                            sm.GroupStopped(2.0)])
    assert decisions[-1] == sm.Exit(EXIT_QUARANTINED, "node quarantined: 2 failures")
    assert state.phase is sm.Phase.QUARANTINED and state.phase.final
    assert state.restart_count == 0
    assert state.root_cause is not None and state.root_cause.exit_code == 1


def test_a_failed_check_while_running_quarantines_at_once() -> None:
    state, decisions = run([*LAUNCHED, sm.NodeQuarantined("node check exited with code 1", 1.0)])
    assert decisions[-1] == sm.StopGroup(sm.StopReason.QUARANTINE)
    state, decision = sm.transition(state, sm.GroupStopped(2.0), POLICY)
    assert decision == sm.Exit(EXIT_QUARANTINED,
                               "node quarantined: node check exited with code 1")
    assert state.root_cause is not None
    assert state.root_cause.kind is sm.FailureKind.NODE_CHECK


def test_a_shutdown_is_not_turned_into_a_quarantine() -> None:
    state, _ = run([*LAUNCHED, sm.ShutdownRequested(15), sm.NodeQuarantined("late", 1.0),
                    sm.GroupStopped(2.0)])
    assert state.phase is sm.Phase.STOPPED and state.exit_code == 143


def test_a_failed_check_before_the_first_round_ends_a_node_nothing_can_replace() -> None:
    state, decisions = run([sm.NodeQuarantined("node check exited with code 1", 1.0)])
    assert state.phase is sm.Phase.QUARANTINED
    assert decisions == [sm.Exit(EXIT_QUARANTINED, "node quarantined: node check exited "
                                                   "with code 1")]


def test_a_quarantine_notice_while_backing_off_is_ignored() -> None:
    state, _ = run([*LAUNCHED, FAILED, sm.GroupStopped(2.0)])
    assert state.phase is sm.Phase.BACKOFF
    new, decision = sm.transition(state, sm.NodeQuarantined("late", 3.0), POLICY)
    assert new == state and decision == sm.Nothing()
