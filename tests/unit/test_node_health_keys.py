"""The node health keys' decoders and the leader's round reasons (no etcd, no loop)."""

from __future__ import annotations

import msgspec

from supervisor.core import nodehealth as nh
from supervisor.core.goodput import cause_of_membership
from supervisor.rendezvous.etcd.node_records import (
    decode_cause,
    decode_record,
    health_prefix,
    lost_reason,
    records_of,
)
from supervisor.rendezvous.etcd.wire.client import KeyValue

PREFIX = "/elastic-supervisor/job/"


def kv(key: str, value: bytes) -> KeyValue:
    return KeyValue(key=key, value=value)


def record(node: str, member: str, held: bool) -> KeyValue:
    rec = nh.NodeRecord(node, member=member)
    if held:
        rec = nh.quarantined(rec, "2 failures", 1.0)
    return kv(health_prefix(PREFIX) + node, msgspec.json.encode(rec))


def test_values_that_are_not_ours_decode_to_nothing() -> None:
    assert decode_cause("c", b"{not json") is None
    assert decode_cause("c", b'{"node": 3}') is None
    assert decode_record("h", b"[]") is None
    assert decode_record("h", b"x" * 300_000) is None
    good = nh.RoundCause("a", 1, nh.Signature("exited", 0, 1), 2.0)
    assert decode_cause("c", msgspec.json.encode(good)) == good


def test_a_record_under_another_nodes_key_is_ignored() -> None:
    forged = kv(health_prefix(PREFIX) + "b", msgspec.json.encode(nh.NodeRecord("a")))
    assert records_of([forged, record("c", "c:1", False)], PREFIX) == [
        nh.NodeRecord("c", member="c:1")]


def test_the_leader_names_a_quarantine_and_the_spare_that_takes_its_place() -> None:
    kvs = {r.key: r for r in (record("a", "a:1", True), record("b", "b:1", False))}
    assert lost_reason(kvs, PREFIX, ["a:1"], []) == "node(s) quarantined: a:1"
    text = lost_reason(kvs, PREFIX, ["a:1", "b:1"], ["d:1"])
    assert text == "node(s) quarantined: a:1; node(s) lost: b:1; spare(s) waiting: d:1"
    assert lost_reason(kvs, PREFIX, ["b:1"], []) == "node(s) lost: b:1"


def test_goodput_causes_of_the_healing_round_reasons() -> None:
    assert cause_of_membership("node(s) quarantined: a") == "node_quarantined"
    assert cause_of_membership("node(s) quarantined: a; spare(s) waiting: d") == (
        "spare_admitted")
    assert cause_of_membership("node(s) lost: b; spare(s) waiting: d") == "spare_admitted"
    assert cause_of_membership("node(s) lost: b") == "node_lost"


def test_a_check_killed_by_someone_elses_signal_is_inconclusive() -> None:
    from supervisor.healing import killed_from_outside

    assert killed_from_outside(nh.CheckResult(False, "killed", 1.0, exit_code=-15))
    assert not killed_from_outside(nh.CheckResult(False, "timed out", 1.0, timed_out=True))
    assert not killed_from_outside(nh.CheckResult(False, "exit 1", 1.0, exit_code=1))
    assert not killed_from_outside(nh.CheckResult(True, "", 1.0, exit_code=0))
