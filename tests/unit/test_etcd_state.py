"""The etcd rendezvous leader's decisions (pure: a key map in, a decision out)."""

from __future__ import annotations

import json
import math
from typing import Any

from supervisor.rendezvous.etcd.keys import (
    Advance,
    Close,
    Keys,
    Policy,
    State,
    Succeed,
    Wait,
    advance_txn,
    close_round_txn,
    decide,
    result_value,
)
from supervisor.rendezvous.etcd.wire.client import KeyValue

KEYS = Keys("job")
POLICY = Policy(min_nodes=2, max_nodes=3, last_call_timeout=5.0)


def state(round_: int = 0, *, join: dict[int, list[str]] | None = None,
          wait: dict[int, list[str]] | None = None, done: dict[int, list[str]] | None = None,
          result: dict[int, list[str]] | None = None, closed: bool = False) -> State:
    kvs: dict[str, KeyValue] = {}
    rev = 1

    def put(key: str, value: Any) -> None:
        nonlocal rev
        kvs[key] = KeyValue(key, json.dumps(value).encode(), rev, rev, 1)
        rev += 1

    put(KEYS.round, {"round": round_})
    for kind, table in (("join", join), ("wait", wait), ("done", done)):
        for n, nodes in (table or {}).items():
            for node in nodes:
                put(KEYS.node(n, kind, node), {"node": node, "addr": "a", "local_world_size": 1})
    for n, nodes in (result or {}).items():
        kvs[KEYS.result(n)] = KeyValue(KEYS.result(n), result_value(
            [{"node": x, "local_world_size": 1} for x in nodes]).encode(), rev, rev, 1)
    if closed:
        put(KEYS.closed, {"ok": True, "reason": "done"})
    return State(KEYS, kvs)


def test_round_below_min_waits_for_more() -> None:
    assert decide(state(join={0: ["a"]}), POLICY, 0.0, min_since=None, grace_until=0) == Wait()


def test_round_at_max_closes_with_the_earliest_joiners() -> None:
    decision = decide(state(join={0: ["c", "a", "b"]}), POLICY, 0.0, min_since=None,
                      grace_until=0)
    assert isinstance(decision, Close) and decision.n == 0
    assert [kv.key.rsplit("/", 1)[1] for kv in decision.chosen] == ["c", "a", "b"]


def test_round_between_min_and_max_waits_for_the_last_call() -> None:
    st = state(join={0: ["a", "b"]})
    assert decide(st, POLICY, 1.0, min_since=1.0, grace_until=0) == Wait(6.0)
    assert isinstance(decide(st, POLICY, 6.0, min_since=1.0, grace_until=0), Close)


def test_round_closes_at_once_when_the_previous_round_rejoined() -> None:
    st = state(1, join={0: ["a", "b"], 1: ["a", "b"]}, result={0: ["a", "b"]})
    assert isinstance(decide(st, POLICY, 0.0, min_since=0.0, grace_until=0), Close)


def chosen(decision: object) -> list[str]:
    assert isinstance(decision, Close), decision
    return [kv.key.rsplit("/", 1)[1] for kv in decision.chosen]


def test_spares_that_join_first_do_not_take_the_places_of_the_members_still_stopping() -> None:
    """Regression (issue 28, two spares, c lost): the spares d and e, with no workers to
    stop, joined round 1 before member b; the round closed at max with d, e, a and b was
    left out, waiting as a spare, while both spares trained."""
    before = {0: ["a", "b"]}  # c's key of round 0 vanished: lost
    st = state(1, join={**before, 1: ["d", "e", "a"]}, wait={0: ["d", "e"]},
               result={0: ["a", "b", "c"]})
    assert decide(st, POLICY, 1.0, min_since=1.0, grace_until=0) == Wait(6.0)
    st = state(1, join={**before, 1: ["d", "e", "a", "b"]}, wait={0: ["d", "e"]},
               result={0: ["a", "b", "c"]})
    assert chosen(decide(st, POLICY, 1.0, min_since=1.0, grace_until=0)) == ["a", "b", "d"]


def test_a_member_that_does_not_rejoin_by_the_last_call_loses_its_place() -> None:
    st = state(1, join={0: ["a", "b"], 1: ["d", "e", "a"]}, wait={0: ["d", "e"]},
               result={0: ["a", "b", "c"]})
    assert sorted(chosen(decide(st, POLICY, 6.0, min_since=1.0, grace_until=0))) == ["a", "d", "e"]


def test_lost_member_opens_a_new_round_after_the_grace() -> None:
    st = state(0, join={0: ["a"]}, result={0: ["a", "b"]})
    assert decide(st, POLICY, 1.0, min_since=None, grace_until=3.0) == Wait(3.0)
    assert decide(st, POLICY, 3.0, min_since=None, grace_until=3.0) == Advance(
        0, "node(s) lost: b")


def test_waiting_node_opens_a_new_round_when_there_is_room() -> None:
    st = state(0, join={0: ["a", "b"]}, wait={0: ["c"]}, result={0: ["a", "b"]})
    assert decide(st, POLICY, 0.0, min_since=None, grace_until=0) == Advance(
        0, "node(s) waiting to join: c")


def test_waiting_node_is_ignored_once_a_member_finished() -> None:
    st = state(0, join={0: ["a", "b"]}, wait={0: ["c"]}, done={0: ["a"]},
               result={0: ["a", "b"]})
    assert decide(st, POLICY, 0.0, min_since=None, grace_until=0) == Wait()


def test_every_member_done_succeeds_and_a_closed_job_waits() -> None:
    st = state(0, join={0: ["a"]}, done={0: ["a", "b"]}, result={0: ["a", "b"]})
    assert decide(st, POLICY, 0.0, min_since=None, grace_until=math.inf) == Succeed()
    assert decide(state(closed=True), POLICY, 0.0, min_since=None, grace_until=0) == Wait()


def test_result_value_is_compact_and_reads_back_in_rank_order() -> None:
    text = result_value([{"node": "b", "local_world_size": 2},
                         {"node": "a", "local_world_size": 2}])
    assert text == '{"nodes":["a","b"],"sizes":2}'
    st = State(KEYS, {KEYS.result(0): KeyValue(KEYS.result(0), text.encode())})
    members = st.members(0)
    assert members is not None
    assert [(m.node, m.local_world_size) for m in members] == [("a", 2), ("b", 2)]


def test_closing_a_round_of_500_stays_within_etcds_default_max_txn_ops() -> None:
    """Regression: the close compared every member's key, and etcd refuses a txn of more
    than --max-txn-ops (default 128) comparisons: rounds of > ~124 nodes never closed."""
    nodes = [f"n{i:04d}" for i in range(500)]
    st = state(join={0: nodes})
    decision = decide(st, Policy(500, 500, 1.0), 0.0, min_since=None, grace_until=0)
    assert isinstance(decision, Close) and len(decision.chosen) == 500
    guard, ops = close_round_txn(st, decision, view_revision=600)
    assert len(guard) <= 8 and len(ops) == 1
    guard, ops = advance_txn(st, "node(s) lost: x", "n0000")
    assert len(guard) <= 8 and len(ops) <= 8
