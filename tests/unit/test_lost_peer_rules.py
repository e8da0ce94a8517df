"""A failure that came from a lost peer is a membership change: the rule that says who is
gone (``core.peers.judge``), the state machine's edge and its cap, and the goodput cause.
Pure: no event loop."""

from __future__ import annotations

from supervisor.accounting import GoodputRecorder
from supervisor.core import state as sm
from supervisor.core.goodput import Outcome
from supervisor.core.peers import LostPeer, PeerAnswer, Seen, judge
from supervisor.core.policy import RestartPolicy
from supervisor.core.statusview import ProgressTable
from supervisor.events import EventLog

POLICY = RestartPolicy(max_restarts=3, peer_loss_limit=2, peer_loss_window=100.0)
REFUSED = "its health endpoint at http://b:1 refused the connection"
LOST = (LostPeer("b", REFUSED),)


def test_a_refused_connection_or_a_gone_lease_is_a_lost_peer() -> None:
    check = judge([PeerAnswer("b", Seen.REFUSED, "http://b:1"),
                   PeerAnswer("c", Seen.NO_ANSWER, "http://c:1"),
                   PeerAnswer("d", Seen.ANSWERED, "http://d:1")],
                  {"b": True, "c": False, "d": True})
    assert check.lost == (LostPeer("b", REFUSED), LostPeer("c", "its lease is gone"))
    assert check.alive == ("d",) and check.unsure == ()


def test_a_slow_or_unknown_peer_is_never_lost() -> None:
    check = judge([PeerAnswer("b", Seen.NO_ANSWER, "http://b:1"), PeerAnswer("c", Seen.NO_URL)],
                  None)
    assert check.lost == () and check.unsure == ("b", "c")
    assert judge([PeerAnswer("b", Seen.NO_ANSWER)], {"b": True}).lost == ()


def test_an_answering_peer_whose_lease_is_gone_was_evicted() -> None:
    check = judge([PeerAnswer("b", Seen.ANSWERED)], {"b": False})
    assert [p.node for p in check.lost] == ["b"] and check.alive == ()


def _failed(state: sm.State, at: float) -> sm.State:
    for event in (sm.RendezvousComplete(1, 2), sm.GroupLaunched(state.attempt + 1,
                                                                  frozenset({0}), at),
                  sm.WorkerExited(state.attempt + 1, 0, 100, 1, None, at + 1)):
        state, _ = sm.transition(state, event, POLICY)
    return state


def _lose_peer(state: sm.State, at: float) -> tuple[sm.State, sm.Decision]:
    state, _ = sm.transition(_failed(state, at), sm.PeerLost(LOST, at + 1.5), POLICY)
    return sm.transition(state, sm.GroupStopped(at + 2), POLICY)


def test_a_lost_peer_makes_the_failure_a_membership_change_without_the_budget() -> None:
    state = _failed(sm.State(), 0.0)
    state, decision = sm.transition(state, sm.PeerLost(LOST, 1.5), POLICY)
    assert decision == sm.Nothing() and state.stop_reason is sm.StopReason.MEMBERSHIP
    assert state.root_cause is not None and state.root_cause.kind is sm.FailureKind.NODE_LOST
    described = state.root_cause.describe()
    assert described.startswith(f"peer lost: node b ({REFUSED}); then local rank 0")
    assert "no restart used" in state.last_decision_reason and "node b" in (
        state.last_decision_reason)
    state, decision = sm.transition(state, sm.GroupStopped(2.0), POLICY)
    assert decision == sm.StartRendezvous() and state.restart_count == 0
    assert state.phase is sm.Phase.RENDEZVOUS


def test_past_the_cap_a_lost_peers_failure_uses_the_budget() -> None:
    state = sm.State()
    for at in (0.0, 10.0):
        state, decision = _lose_peer(state, at)
        assert decision == sm.StartRendezvous() and state.restart_count == 0
    state, decision = _lose_peer(state, 20.0)
    assert isinstance(decision, sm.StartBackoff) and state.restart_count == 1
    assert "uses the restart budget" in state.last_decision_reason or (
        state.last_decision_reason.startswith("restart 1/3"))
    # the window slides: 100 s after the first, one is free again
    state, _ = sm.transition(state, sm.BackoffElapsed(), POLICY)
    state, decision = _lose_peer(state, 101.0)
    assert decision == sm.StartRendezvous() and state.restart_count == 1


def test_past_the_cap_the_reason_says_why_the_budget_is_used() -> None:
    state = sm.State()
    for at in (0.0, 10.0):
        state, _ = _lose_peer(state, at)
    state, decision = sm.transition(_failed(state, 20.0), sm.PeerLost(LOST, 21.5), POLICY)
    assert decision == sm.Nothing() and state.stop_reason is sm.StopReason.FAILURE
    assert "2 restart(s) for lost peers in the last 100 s" in state.last_decision_reason


def test_a_lost_peer_learned_during_a_shutdown_changes_nothing() -> None:
    state = _failed(sm.State(), 0.0)
    state, _ = sm.transition(state, sm.ShutdownRequested(15), POLICY)
    state, _ = sm.transition(state, sm.PeerLost(LOST, 1.5), POLICY)
    state, decision = sm.transition(state, sm.GroupStopped(2.0), POLICY)
    assert isinstance(decision, sm.Exit) and decision.code == 143


def test_the_goodput_record_of_a_lost_peer_says_node_lost() -> None:
    clock = [0.0]
    recorder = GoodputRecorder(EventLog(None, "job"), ProgressTable(), started=0.0, bound=5.0,
                               clock=lambda: clock[0])
    state = sm.State()
    for event in (sm.RendezvousComplete(1, 2), sm.GroupLaunched(1, frozenset({0}), 0.0),
                  sm.WorkerExited(1, 0, 100, 1, None, 1.0), sm.PeerLost(LOST, 1.5),
                  sm.GroupStopped(2.0)):
        old = state
        state, decision = sm.transition(state, event, POLICY)
        recorder.on_transition(old, state, event, decision)
    record = recorder.ledger().last
    assert record is not None and record.cause == "node_lost"
    assert record.outcome is Outcome.OPEN and "node b" in record.message


def test_a_long_worker_error_is_one_bounded_line() -> None:
    """Issue 53, item 5: a gloo error (~300 characters, repeated by several lines) is cut."""
    error = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:"
             "537] Read error [127.0.0.1]:1722: Connection reset by peer.\n" + "x" * 400)
    failure = sm.Failure(sm.FailureKind.EXITED, 1, 0.0, 0, 10, exit_code=1, message=error)
    text = failure.describe()
    assert "\n" not in text and len(text) <= sm.MAX_MESSAGE + 60 and text.endswith("...")
    assert text.startswith("local rank 0 (pid 10) exited with code 1: RuntimeError: ")
