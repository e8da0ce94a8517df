"""Buddy copies' pure rules: the ring, what a node sends, what a buddy admits, the pace."""

from __future__ import annotations

import pytest

from supervisor.core.buddies import (
    BadMembers,
    Offer,
    Pace,
    admit,
    newest_local,
    plan,
    replanned,
)
from supervisor.core.slots import REPLICATED, Reserved, SlotTable
from supervisor.snapshots.replicate.auth import PeerTls, peer_tls

MIB = 1 << 20


def test_every_node_has_exactly_one_copy_elsewhere() -> None:
    ring = plan(["a", "b", "c", "d"])
    pairs = ring.pairs()
    assert sorted(pairs) == ["a", "b", "c", "d"]
    assert sorted(pairs.values()) == ["a", "b", "c", "d"]  # each keeps exactly one copy
    assert all(node != buddy for node, buddy in pairs.items())
    assert all(ring.ward_of(buddy) == node for node, buddy in pairs.items())


def test_the_ring_follows_the_round_order() -> None:
    ring = plan(["n2", "n0", "n1"])
    assert ring.pairs() == {"n2": "n0", "n0": "n1", "n1": "n2"}


def test_two_nodes_keep_each_others_copy() -> None:
    assert plan(["a", "b"]).pairs() == {"a": "b", "b": "a"}


def test_a_round_of_one_has_no_buddy() -> None:
    ring = plan(["a"])
    assert ring.buddy_of("a") is None and ring.ward_of("a") is None and ring.pairs() == {}


def test_a_node_outside_the_round_has_no_buddy() -> None:
    assert plan(["a", "b"]).buddy_of("z") is None


def test_a_changed_membership_picks_new_buddies() -> None:
    old, new = plan(["a", "b", "c"]), plan(["a", "b", "d"])  # c lost, spare d joins
    assert new.buddy_of("b") == "d" and new.ward_of("a") == "d"
    assert replanned(old, new, "a") and replanned(old, new, "b")
    assert replanned(None, new, "d")


def test_an_unchanged_round_keeps_its_buddies() -> None:
    assert not replanned(plan(["a", "b", "c"]), plan(["a", "b", "c"]), "b")
    assert not replanned(None, plan(["a"]), "a")


@pytest.mark.parametrize("members", [["a", "a"], ["a", ""]])
def test_members_that_cannot_form_a_ring_are_refused(members: list[str]) -> None:
    with pytest.raises(BadMembers):
        plan(members)


def _saved(table: SlotTable, key: int, step: int) -> None:
    reserved = table.reserve(key, step, MIB)
    assert isinstance(reserved, Reserved)
    table.commit(key, reserved.slot.index, step, MIB, checksum=step, now=0.0)


def test_a_node_sends_the_newest_step_every_one_of_its_ranks_completed() -> None:
    table = SlotTable()
    table.decide(4)
    for step in (1, 2, 3):
        _saved(table, 2, step)
    for step in (1, 2):
        _saved(table, 3, step)
    _saved(table, 0, 9)  # another node's rank: not this node's business
    outgoing = newest_local(table.complete(), {2, 3}, 4)
    assert outgoing is not None and outgoing.step == 2 and sorted(outgoing.slots) == [2, 3]


def test_nothing_is_sent_before_every_rank_completed_a_step() -> None:
    table = SlotTable()
    table.decide(2)
    _saved(table, 0, 1)
    assert newest_local(table.complete(), {0, 1}, 2) is None
    assert newest_local(table.complete(), set(), 2) is None


def test_a_replicated_copy_is_never_sent() -> None:
    table = SlotTable()
    table.decide(2)
    reserved = table.reserve(REPLICATED, 5, MIB)
    assert isinstance(reserved, Reserved)
    table.commit(REPLICATED, reserved.slot.index, 5, MIB, checksum=1, now=0.0)
    assert newest_local(table.complete(), {0, 1}, 2) is None


def test_a_slot_being_sent_is_never_written_and_saves_go_on() -> None:
    table = SlotTable()
    table.decide(1)
    for step in (1, 2):
        _saved(table, 0, step)
    outgoing = newest_local(table.complete(), {0}, 1)
    assert outgoing is not None
    table.add_reader(outgoing.slots[0])
    for step in range(3, 10):  # saves keep being kept while the copy is read
        reserved = table.reserve(0, step, MIB)
        assert isinstance(reserved, Reserved)
        assert reserved.slot.index != outgoing.slots[0].index
        table.commit(0, reserved.slot.index, step, MIB, checksum=step, now=0.0)
    table.drop_reader(outgoing.slots[0])
    assert table.readers == {}


def _offer(step: int = 5, sizes: dict[int, int] | None = None, node: str = "a") -> Offer:
    sizes = {0: MIB, 1: MIB} if sizes is None else sizes
    return Offer(node, step, 4, sizes, dict.fromkeys(sizes, 7))


def test_a_buddy_admits_a_newer_step_of_its_ward() -> None:
    assert admit(_offer(), 4, limit=None, expected=frozenset({"a"}), max_ranks=8) is None
    assert admit(_offer(), None, limit=None, expected=None, max_ranks=8) is None


@pytest.mark.parametrize(("offer", "held", "limit", "expected", "why"), [
    (_offer(node="x"), None, None, frozenset({"a"}), "keeps no copy"),
    (_offer(step=4), 4, None, None, "not newer"),
    (_offer(sizes={0: 2 * MIB}), None, MIB, None, "snapshot-memory-limit"),
    (_offer(sizes={}), None, None, None, "ranks"),
    (_offer(sizes={9: MIB}), None, None, None, "outside the world"),
    (_offer(sizes={0: 0}), None, None, None, "no bytes"),
])
def test_a_buddy_refuses_saying_why(offer: Offer, held: int | None, limit: int | None,
                                    expected: frozenset[str] | None, why: str) -> None:
    reason = admit(offer, held, limit=limit, expected=expected, max_ranks=8)
    assert reason is not None and why in reason


def test_no_pace_means_no_wait() -> None:
    assert Pace(None).delay(1 << 30, 0.0) == 0.0


def test_the_pace_holds_the_rate() -> None:
    pace = Pace(100.0)
    now, sent = 0.0, 0
    for _ in range(10):
        now += pace.delay(50, now)
        sent += 50
    assert sent / now == pytest.approx(100.0, rel=0.11)


def test_an_idle_pause_gives_at_most_a_second_of_credit() -> None:
    pace = Pace(100.0)
    pace.delay(100, 0.0)
    assert pace.delay(100, 60.0) == 0.0  # a second's worth, after a long pause
    assert pace.delay(100, 60.0) == pytest.approx(1.0)


def test_mutual_tls_needs_a_ca_a_certificate_and_its_key() -> None:
    full = {"cacert": "ca.pem", "cert": "node.pem", "key": "node.key", "user": "u"}
    assert peer_tls(full) == PeerTls("ca.pem", "node.pem", "node.key")
    assert peer_tls({"cacert": "ca.pem", "password_file": "p"}) is None  # the secret, then
    assert peer_tls({}) is None
