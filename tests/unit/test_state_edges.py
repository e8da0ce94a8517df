"""Every phase x every event: an edge, a stale drop (an earlier attempt's event) or a
named error. Pure: no event loop. The table is the state machine's contract with the
controller: a current attempt's WorkerExited is never dropped as stale, and is an edge in
every phase in which a worker of the current attempt can still be alive."""

from __future__ import annotations

import pytest

from supervisor.core import state as sm
from supervisor.core.peers import LostPeer
from supervisor.core.policy import RestartPolicy

E, X = sm.Verdict.EDGE, sm.Verdict.ERROR
CURRENT, EARLIER = 2, 1

EVENTS: dict[str, sm.Event] = {
    "RendezvousComplete": sm.RendezvousComplete(1, 2),
    "RendezvousFailed": sm.RendezvousFailed("unreachable", 1.0),
    "LaunchFailed": sm.LaunchFailed(CURRENT + 1, "disk full", 1.0),
    "GroupLaunched": sm.GroupLaunched(CURRENT + 1, frozenset({0, 1}), 1.0),
    "WorkerExited(0)": sm.WorkerExited(CURRENT, 0, 10, 0, None, 1.0),
    "WorkerExited(1)": sm.WorkerExited(CURRENT, 0, 10, 1, None, 1.0),
    "WorkerFailedToStart": sm.WorkerFailedToStart(CURRENT, 1, "E2BIG", 1.0),
    "DeadlineExpired": sm.DeadlineExpired(CURRENT, 0, 10, "step", 0.1, 1.0),
    "WorkerUnhealthy": sm.WorkerUnhealthy(CURRENT, 0, 10, "D state", 1.0),
    "RemoteFailure": sm.RemoteFailure("node b failed", 1.0),
    "MembershipChanged": sm.MembershipChanged("node joined", CURRENT),
    "ShutdownRequested": sm.ShutdownRequested(15),
    "GroupStopped": sm.GroupStopped(1.0),
    "BackoffElapsed": sm.BackoffElapsed(),
    "BarrierDone": sm.BarrierDone(),
    "NodeQuarantined": sm.NodeQuarantined("node check failed", 1.0),
    "PeerLost": sm.PeerLost((LostPeer("b", "its health endpoint refused the connection"),),
                            1.0),
}
NAMES = list(EVENTS)

# columns in the order of NAMES
TABLE: dict[sm.Phase, list[sm.Verdict]] = {
    #             RdvC RdvF LnchF Lnchd Ex0 Ex1 NoSt Dead Unh Rem Memb Shut Stop Back Barr Quar Lst
    sm.Phase.RENDEZVOUS: [E, E, X, X, X, X, X, X, X, E, E, E, X, X, X, E, E],
    sm.Phase.STARTING: [X, X, E, E, X, X, X, X, X, X, X, E, X, X, X, X, E],
    sm.Phase.RUNNING: [X, X, X, X, E, E, E, E, E, E, E, E, X, X, X, E, E],
    # a shutdown request queued before the launch's report meets it here: LnchF, Lnchd
    sm.Phase.STOPPING: [X, X, E, E, E, E, E, E, E, E, E, E, E, X, X, E, E],
    sm.Phase.BACKOFF: [X, X, X, X, X, X, X, E, E, E, E, E, X, E, X, E, E],
    sm.Phase.EXIT_BARRIER: [X, X, X, X, X, X, X, E, E, E, E, E, X, X, E, E, E],
    # final: late events are recorded only
    sm.Phase.SUCCEEDED: [E] * len(NAMES),
    sm.Phase.FAILED: [E] * len(NAMES),
    sm.Phase.STOPPED: [E] * len(NAMES),
    sm.Phase.QUARANTINED: [E] * len(NAMES),
}


def _state(phase: sm.Phase) -> sm.State:
    reason = sm.StopReason.FAILURE if phase is sm.Phase.STOPPING else None
    return sm.State(phase=phase, attempt=CURRENT, running=frozenset({0, 1}), stop_reason=reason)


def test_the_table_covers_every_phase_and_event() -> None:
    assert set(TABLE) == set(sm.Phase)
    assert {type(e) for e in EVENTS.values()} == set(sm.Event.__args__)


@pytest.mark.parametrize("phase", list(sm.Phase), ids=lambda p: p.name)
def test_current_events_are_edges_or_named_errors(phase: sm.Phase) -> None:
    policy = RestartPolicy(max_restarts=3)
    got = [sm.classify(_state(phase), EVENTS[name], policy) for name in NAMES]
    assert dict(zip(NAMES, got, strict=True)) == dict(zip(NAMES, TABLE[phase], strict=True))
    for name, verdict in zip(NAMES, got, strict=True):
        if verdict is X:
            with pytest.raises(sm.InvalidTransition):
                sm.transition(_state(phase), EVENTS[name], policy)


@pytest.mark.parametrize("phase", list(sm.Phase), ids=lambda p: p.name)
@pytest.mark.parametrize("name", ["WorkerExited(0)", "WorkerExited(1)", "DeadlineExpired",
                                  "WorkerUnhealthy", "MembershipChanged",
                                  "WorkerFailedToStart"])
def test_an_earlier_attempts_event_is_a_stale_drop(phase: sm.Phase, name: str) -> None:
    event = EVENTS[name]
    assert isinstance(event, sm.AttemptEvent)
    old = type(event)(**{**{f: getattr(event, f) for f in event.__struct_fields__},
                         "attempt": EARLIER})
    assert sm.classify(_state(phase), old, RestartPolicy()) is sm.Verdict.STALE


def test_a_current_worker_exit_is_never_stale_and_an_edge_while_workers_live() -> None:
    for phase in sm.Phase:
        for name in ("WorkerExited(0)", "WorkerExited(1)"):
            verdict = sm.classify(_state(phase), EVENTS[name], RestartPolicy())
            assert verdict is not sm.Verdict.STALE
            if phase in (sm.Phase.RUNNING, sm.Phase.STOPPING):
                assert verdict is E


def test_launch_events_carry_the_next_attempt_and_are_never_stale() -> None:
    for phase in sm.Phase:
        for name in ("GroupLaunched", "LaunchFailed"):
            assert not sm.is_stale(_state(phase), EVENTS[name])


def test_a_membership_change_of_no_attempt_is_never_stale() -> None:
    assert not sm.is_stale(_state(sm.Phase.RUNNING), sm.MembershipChanged("joined"))
