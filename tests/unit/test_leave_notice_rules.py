"""The rules of a leave told to the peers directly (supervisor/core/leave_notice.py):
who tells whom, what is admitted, what confirms a leave. Pure functions."""

from __future__ import annotations

from typing import Any

import pytest

from supervisor.core.leave_notice import (
    MAX_NODE_ID,
    LeaveNotice,
    admit,
    confirms_leave,
    notice_body,
    parse_notice,
    tells,
    told_by,
)
from supervisor.core.partition import peers_to_ask

RUN = "job-1"


def test_a_notice_round_trips() -> None:
    assert parse_notice(notice_body(RUN, "c", 4), RUN) == LeaveNotice("c", 4)


@pytest.mark.parametrize(("doc", "why"), [
    ([], "not a JSON object"),
    ("c", "not a JSON object"),
    ({"run_id": "other", "node": "c", "round": 1}, "not this job's"),
    ({"node": "c", "round": 1}, "not this job's"),
    ({"run_id": RUN, "round": 1}, "no node id"),
    ({"run_id": RUN, "node": "", "round": 1}, "no node id"),
    ({"run_id": RUN, "node": "x" * (MAX_NODE_ID + 1), "round": 1}, "no node id"),
    ({"run_id": RUN, "node": 7, "round": 1}, "no node id"),
    ({"run_id": RUN, "node": "c"}, "no round"),
    ({"run_id": RUN, "node": "c", "round": -1}, "no round"),
    ({"run_id": RUN, "node": "c", "round": True}, "no round"),
    ({"run_id": RUN, "node": "c", "round": 1.0}, "no round"),
    ({"run_id": RUN, "node": "c", "round": "1"}, "no round"),
])
def test_malformed_notices_are_refused_with_a_reason(doc: Any, why: str) -> None:
    result = parse_notice(doc, RUN)
    assert isinstance(result, str) and why in result


def test_told_by_is_the_inverse_of_tells_for_every_size() -> None:
    for n in range(1, 12):
        members = [f"n{i}" for i in range(n)]
        for me in members:
            expected = sorted(x for x in members if me in tells(members, x))
            assert sorted(told_by(members, me)) == expected, (n, me)


def test_a_leaving_node_tells_the_peers_its_cut_off_check_asks() -> None:
    members = [f"n{i}" for i in range(8)]
    assert tells(members, "n6") == peers_to_ask(members, "n6", 3) == ["n7", "n0", "n1"]
    assert told_by(members, "n1") == ["n0", "n7", "n6"]
    assert tells(["a", "b", "c"], "c") == ["a", "b"]
    assert told_by(["a", "b", "c"], "a") == ["c", "b"]


def test_a_node_outside_the_round_tells_and_is_told_nothing() -> None:
    assert tells(["a", "b"], "z") == [] and told_by(["a", "b"], "z") == []


def test_admit_checks_the_round_and_the_teller() -> None:
    members = [f"n{i}" for i in range(8)]
    ok = LeaveNotice("n0", 3)
    assert admit(ok, me="n1", my_round=3, members=members) is None
    assert "round 3, not 2" in str(admit(LeaveNotice("n0", 2), me="n1", my_round=3,
                                         members=members))
    assert "runs no round" in str(admit(ok, me="n1", my_round=-1, members=members))
    # n4 tells n5, n6, n7: not n1; n1 itself and strangers neither
    for node in ("n4", "n1", "zz"):
        why = admit(LeaveNotice(node, 3), me="n1", my_round=3, members=members)
        assert why is not None and "tells this node" in why


def status(left: object, run_id: str = RUN) -> dict[str, Any]:
    return {"run_id": run_id, "rendezvous": {"round": 3, "etcd": {"left_round": left}}}


def test_only_the_peer_saying_it_left_that_round_confirms() -> None:
    assert confirms_leave(status(3), RUN, 3)
    assert not confirms_leave(status(None), RUN, 3)  # still running
    assert not confirms_leave(status(2), RUN, 3)
    assert not confirms_leave(status(True), RUN, 1)
    assert not confirms_leave(status("3"), RUN, 3)
    assert not confirms_leave(status(3, run_id="other"), RUN, 3)
    for junk in (None, [], "x", {"run_id": RUN}, {"run_id": RUN, "rendezvous": []},
                 {"run_id": RUN, "rendezvous": {"etcd": 3}}):
        assert not confirms_leave(junk, RUN, 3)
