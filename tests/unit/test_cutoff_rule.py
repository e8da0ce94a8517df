"""The cut-off rule (supervisor/core/partition.py): each case of docs/rendezvous.md,
Outages, "Who is cut off", as a pure function of what the peers said."""

from __future__ import annotations

from typing import Any

import pytest

from supervisor.core.partition import (
    Cutoff,
    PeerReport,
    judge,
    parse_peer_status,
    peers_to_ask,
    standing_since,
)

TTL, RTT = 10.0, 3.0
SENT = 100.0  # the last lease refresh etcd answered was sent then
EXPIRED = SENT + RTT + TTL  # the lease is surely gone from then on


def verdict(*reports: PeerReport, now: float = EXPIRED + 0.1, my_round: int = 4) -> Any:
    return judge(my_round=my_round, last_refresh_sent=SENT, now=now, ttl=TTL, max_rtt=RTT,
                 reports=list(reports))


def up(node: str = "b", round_: int = 4) -> PeerReport:
    return PeerReport(node, answered=True, reaches_etcd=True, round=round_)


def down(node: str = "b", round_: int = 4) -> PeerReport:
    return PeerReport(node, answered=True, reaches_etcd=False, round=round_)


def silent(node: str = "b") -> PeerReport:
    return PeerReport(node, answered=False)


def test_no_peer_answers_rides_out() -> None:
    """Cut off from everything, or the peers are down: it cannot tell, so as today."""
    v = verdict(silent("b"), silent("c"))
    assert v.action is Cutoff.RIDE_OUT and "no peer answers (2 asked)" in v.reason


def test_no_peers_known_rides_out() -> None:
    assert verdict().action is Cutoff.RIDE_OUT


def test_every_answering_peer_without_etcd_is_an_outage_for_everyone() -> None:
    v = verdict(down("b"), silent("c"), down("d"))
    assert v.action is Cutoff.RIDE_OUT and "none reaches etcd" in v.reason


def test_a_peer_reaching_etcd_stops_this_node_once_its_lease_surely_expired() -> None:
    v = verdict(down("b"), up("c"))
    assert v.action is Cutoff.STOP and "peer(s) c reach etcd" in v.reason


def test_before_the_lease_surely_expired_it_waits_until_then() -> None:
    """The others re-form only once the lease expired: stopping earlier would stop a group
    that is still the job's (an outage that heals within the TTL changes nothing)."""
    v = verdict(up("c"), now=EXPIRED - 2.0)
    assert v.action is Cutoff.WAIT and v.until == EXPIRED


def test_the_wait_covers_the_slowest_refresh_it_may_have_been() -> None:
    """A refresh sent at SENT may have reached etcd up to RTT later, renewing it then."""
    assert verdict(up("c"), now=SENT + TTL + 0.5).action is Cutoff.WAIT


def test_a_peer_in_a_newer_round_stops_this_node_at_once() -> None:
    v = verdict(down("b", round_=5), now=SENT + 1.0)
    assert v.action is Cutoff.STOP and "runs round 5" in v.reason


def test_after_an_outage_for_everyone_the_clock_starts_when_it_ended() -> None:
    """Regression (seen in tests/e2e/test_network_faults.py): etcd's link was down for 2x
    the TTL, every lease expired, and one request failing just after etcd came back made a
    node judge "peers reach etcd, my lease expired long ago": it stopped although the
    leader waits one TTL for every member's keys."""
    since = standing_since(SENT, SENT + 60.0)
    v = judge(my_round=4, last_refresh_sent=since, now=SENT + 60.1, ttl=TTL, max_rtt=RTT,
              reports=[up("c")])
    assert v.action is Cutoff.WAIT
    assert standing_since(SENT, None) == SENT and standing_since(SENT, SENT - 5) == SENT


def test_a_peer_in_an_older_round_is_no_evidence() -> None:
    assert verdict(down("b", round_=3)).action is Cutoff.RIDE_OUT


JOB = "job-1"


def status(**rendezvous: Any) -> dict[str, Any]:
    rdzv = {"round": 4, "etcd": {"reachable": True}, **rendezvous}
    return {"run_id": JOB, "rendezvous": rdzv}


def test_a_status_document_becomes_a_report() -> None:
    assert parse_peer_status("b", status(), JOB) == up("b")
    assert parse_peer_status("b", status(etcd={"reachable": False}), JOB) == down("b")


@pytest.mark.parametrize("doc", [
    None, [], "ok", {"run_id": "other-job", "rendezvous": status()["rendezvous"]},
    {"run_id": JOB}, {"run_id": JOB, "rendezvous": []}, status(round="4"), status(round=-1),
    status(round=True), status(etcd=None), status(etcd={"reachable": "yes"}),
    status(etcd={}),
])
def test_anything_else_a_peer_sends_is_a_peer_that_did_not_answer(doc: object) -> None:
    """A peer's answer is untrusted: a malformed document, or another job on that port,
    must never count as evidence either way."""
    assert parse_peer_status("b", doc, JOB) == silent("b")


def test_peers_asked_are_the_next_ones_in_rank_order_wrapping() -> None:
    members = ["a", "b", "c", "d", "e"]
    assert peers_to_ask(members, "d", 3) == ["e", "a", "b"]
    assert peers_to_ask(members, "a", 2) == ["b", "c"]
    assert peers_to_ask(["a"], "a", 3) == []
    assert peers_to_ask(["a", "b"], "z", 3) == ["a", "b"]


def test_a_witness_just_back_from_an_outage_gives_this_node_a_ttl_from_then() -> None:
    """An outage for everyone longer than the TTL: the first peer to reconnect must not
    stop a node that has not reconnected yet (seen once: that node restarted its group)."""
    now = EXPIRED + 30.0  # this node's last refresh is long past its TTL
    just_back = PeerReport("b", answered=True, reaches_etcd=True, round=4, recovered_for=0.2)
    v = verdict(just_back, now=now)
    assert v.action is Cutoff.WAIT and v.until == pytest.approx(now - 0.2 + RTT + TTL)
    long_back = PeerReport("b", answered=True, reaches_etcd=True, round=4, recovered_for=60.0)
    assert verdict(long_back, now=now).action is Cutoff.STOP  # it was back long enough


def test_the_earliest_reconnection_among_the_witnesses_counts() -> None:
    now = EXPIRED + 30.0
    v = verdict(PeerReport("b", True, True, 4, recovered_for=0.2),
                PeerReport("c", True, True, 4, recovered_for=25.0), now=now)
    assert v.action is Cutoff.STOP  # c was back 25 s ago: more than a TTL and the RTT


@pytest.mark.parametrize("value", [-1, float("inf"), float("nan"), "3", True, None, [1]])
def test_a_recovered_for_that_is_not_a_duration_is_not_known(value: object) -> None:
    doc = {"run_id": "job", "rendezvous": {"round": 4, "etcd": {
        "reachable": True, "recovered_for": value}}}
    assert parse_peer_status("b", doc, "job").recovered_for is None


def test_a_recovered_for_is_read_from_the_status() -> None:
    doc = {"run_id": "job", "rendezvous": {"round": 4, "etcd": {
        "reachable": True, "recovered_for": 1.5}}}
    assert parse_peer_status("b", doc, "job").recovered_for == 1.5
