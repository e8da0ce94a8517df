"""The job-wide restore step a round decides (``core.jobstep``), its wire form
(``rendezvous.etcd.wire.jobstep``) and a node's side of it (``SlotTable.settle``): pure."""

from __future__ import annotations

import json

import msgspec
import pytest

from supervisor.core.jobstep import DiskStep, JobStep, Report, Span, decide, make_report, spans
from supervisor.core.slots import REPLICATED, Reserved, SlotTable, slots_at, steps_held
from supervisor.rendezvous.etcd.keys import result_value
from supervisor.rendezvous.etcd.wire.decode import Join, Result, decode
from supervisor.rendezvous.etcd.wire.jobstep import WireReport, report_value


def held(steps: list[int], ranks: range, world: int) -> list[tuple[int, int, int]]:
    return [(step, world, rank) for step in steps for rank in ranks]


def node(steps: list[int], ranks: range, world: int = 4, *, disk: tuple[DiskStep, ...] = ()
         ) -> Report:
    return make_report(held(steps, ranks, world), [], disk)


def test_two_nodes_restore_the_newest_step_both_hold() -> None:
    a, b = node([3, 4, 5], range(0, 2)), node([3, 4], range(2, 4))
    assert decide([(2, a), (2, b)]) == JobStep(4, 5)


def test_a_rank_missing_a_step_on_its_node_rules_the_step_out() -> None:
    # rank 3 never completed step 4: the common step is 3
    b = make_report([*held([3], range(2, 4), 4), (4, 4, 2)], [], ())
    assert decide([(2, node([3, 4], range(0, 2))), (2, b)]) == JobStep(3, 4)


def test_ranks_held_by_another_node_than_the_one_that_runs_them_do_not_count() -> None:
    # the nodes swapped places (group ranks follow node ids): each holds the other's ranks
    a, b = node([4], range(2, 4)), node([4], range(0, 2))
    assert decide([(2, a), (2, b)]) == JobStep(None, 4)


def test_a_rank_held_by_no_member_falls_back_to_the_snapshot_dir() -> None:
    # a spare replaced the node of ranks 2-3: it reads step 4 from DIR, not step 5
    a = node([4, 5], range(0, 2), disk=(DiskStep(4, 4, False),))
    spare = make_report([], [], [DiskStep(4, 4, False)])
    assert decide([(2, a), (2, spare)]) == JobStep(4, 5)


def test_a_step_in_dir_of_another_world_size_is_no_fallback_for_per_rank_shards() -> None:
    spare = make_report([], [], [DiskStep(4, 2, False)])
    assert decide([(2, node([4], range(0, 2))), (2, spare)]) == JobStep(None, 4)
    spare = make_report([], [], [DiskStep(4, 2, True)])  # replicated: any world size
    assert decide([(2, node([4], range(0, 2))), (2, spare)]) == JobStep(4, 4)


def test_replicated_copies_fit_any_world_size_and_each_node_needs_one() -> None:
    a, b = make_report([], [6, 7], []), make_report([], [7], [])
    assert decide([(3, a), (5, b)]) == JobStep(7, 7)
    assert decide([(3, a), (5, Report())]) == JobStep(None, 7)


def test_per_rank_snapshots_of_another_world_size_are_not_restored() -> None:
    # a node was lost: the world of 4 is now a world of 2
    assert decide([(2, node([4], range(0, 2), world=4))]) == JobStep(None, 4)


def test_a_member_without_a_report_holds_nothing() -> None:
    assert decide([(2, node([4], range(0, 2))), (2, None)]) == JobStep(None, 4)
    assert decide([]) == JobStep(None, None)


def test_spans_compress_consecutive_ranks_and_keep_the_newest_steps() -> None:
    assert spans([(4, 8, r) for r in (0, 1, 2, 5)]) == (Span(4, 8, 0, 2), Span(4, 8, 5, 5))
    many = spans([(step, 8, step % 2) for step in range(100)])
    assert len(many) == 32 and many[0].step == 99


def test_the_wire_form_round_trips_and_rides_in_the_join_and_the_result() -> None:
    report = make_report(held([4, 5], range(0, 2), 4), [9], [DiskStep(3, 4, False)])
    join = {"node": "a", "addr": "x", "local_world_size": 2, "snap": report_value(report)}
    decoded = decode("nodes/join", "k", json.dumps(join).encode(), Join)
    assert decoded is not None and decoded.snap is not None
    assert decoded.snap.report() == report
    other = WireReport(m=[(5, 4, 2, 3)])
    text = result_value([{"node": "b", "local_world_size": 2, "snap": other},
                         {"node": "a", "local_world_size": 2, "snap": decoded.snap}])
    result = msgspec.json.decode(text, type=Result)
    assert result.snap is not None and result.snap.job_step() == JobStep(5, 9)
    # no member reported (snapshots off everywhere): the result is as before
    assert "snap" not in result_value([{"node": "a", "local_world_size": 2}])


@pytest.mark.parametrize("bad", [
    {"m": [[4, 2, 3, 1]]},  # first > last
    {"m": [[4, 2, 0, 2]]},  # a rank beyond its world size
    {"m": [[-1, 2, 0, 1]]},
    {"m": [[4, 2, 0, 1]] * 33},  # too many spans
    {"d": [[4, 2, 2]]},
])
def test_a_malformed_report_ignores_the_join(bad: dict[str, object]) -> None:
    join = {"node": "a", "addr": "x", "local_world_size": 2, "snap": bad}
    assert decode("nodes/join", "k", json.dumps(join).encode(), Join) is None


def committed(table: SlotTable, key: int, step: int) -> None:
    reserved = table.reserve(key, step, 100)
    assert isinstance(reserved, Reserved)
    table.commit(key, reserved.slot.index, step, 100, 1, 0.0)


def test_a_node_settles_on_the_rounds_step_and_says_what_it_must_read_from_disk() -> None:
    table = SlotTable(world_size=4)
    for step in (3, 4, 5):
        committed(table, 2, step)
    committed(table, 3, 3)
    committed(table, 0, 3)  # a rank this node no longer runs
    per_rank, replicated = table.held()
    assert sorted(per_rank) == [(3, 4, 0), (3, 4, 2), (3, 4, 3), (4, 4, 2), (5, 4, 2)]
    assert replicated == []
    restore, missing = table.settle(4, 4, range(2, 4), 5)
    assert restore is not None and restore.step == 4 and set(restore.slots) == {2}
    assert missing == [3] and restore.newest == 5
    assert 0 not in table.slots  # its regions are freed
    assert {s.step for s in table.complete()} == {3, 4}  # step 5: another timeline


def test_a_node_settles_on_its_replicated_copy_and_on_nothing() -> None:
    table = SlotTable(world_size=2)
    committed(table, REPLICATED, 7)
    restore, missing = table.settle(6, 7, range(4, 6), 7)
    assert restore is not None and restore.replicated and missing == []
    restore, missing = table.settle(6, None, range(4, 6), 7)
    assert restore is None and missing == [] and table.complete() == []


def test_a_node_persists_only_steps_it_holds_for_every_rank_it_runs() -> None:
    table = SlotTable(world_size=4)
    for step in (3, 4):
        committed(table, 2, step)
    committed(table, 3, 3)
    assert steps_held(table.complete(), range(2, 4), 4) == [3]
    assert steps_held(table.complete(), range(2, 4), 2) == []  # saved under another world
    slots = slots_at(table.complete(), 3, range(2, 4), 4)
    assert slots is not None and set(slots) == {2, 3}
    assert slots_at(table.complete(), 4, range(2, 4), 4) is None
    committed(table, REPLICATED, 5)
    replicated = slots_at(table.complete(), 5, range(2, 4), 4)
    assert replicated is not None and set(replicated) == {REPLICATED}
