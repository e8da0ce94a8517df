"""The snapshot slot table: which slot a save writes, what is complete, the restore step."""

from __future__ import annotations

from supervisor.core.slots import (
    MAX_SLOTS,
    REPLICATED,
    Held,
    Refused,
    Reserved,
    SlotState,
    SlotTable,
    choose,
    region_size,
)

MIB = 1 << 20


def saved(table: SlotTable, key: int, step: int, size: int = MIB) -> int:
    """Reserve and commit ``step`` for ``key``; the slot index it went to."""
    reserved = table.reserve(key, step, size)
    assert isinstance(reserved, Reserved), reserved
    done = table.commit(key, reserved.slot.index, step, size, checksum=step, now=float(step))
    assert not isinstance(done, Refused), done
    return reserved.slot.index


def steps(table: SlotTable, key: int) -> list[int]:
    return sorted(s.step for s in table.slots.get(key, []) if s.state is SlotState.COMPLETE
                  and s.step is not None)


def test_a_key_keeps_at_most_three_slots_and_the_two_newest_steps() -> None:
    table = SlotTable(world_size=1)
    table.decide(1)
    for step in range(10):
        saved(table, 0, step)
    assert len(table.slots[0]) == MAX_SLOTS
    assert steps(table, 0)[-2:] == [8, 9]


def test_a_step_not_above_the_last_is_refused() -> None:
    table = SlotTable()
    table.decide(1)
    saved(table, 0, 5)
    assert isinstance(table.reserve(0, 5, MIB), Refused)
    assert isinstance(table.reserve(0, 4, MIB), Refused)


def test_a_state_above_the_limit_is_refused() -> None:
    table = SlotTable()
    refused = table.reserve(0, 1, 10 * MIB, limit=MIB)
    assert isinstance(refused, Refused) and "limit" in refused.reason


def test_a_commit_without_its_reservation_is_refused() -> None:
    table = SlotTable()
    reserved = table.reserve(0, 1, MIB)
    assert isinstance(reserved, Reserved)
    assert isinstance(table.commit(0, reserved.slot.index, 2, MIB, 0, 0.0), Refused)
    assert isinstance(table.commit(0, 2, 1, MIB, 0, 0.0), Refused)
    assert isinstance(table.commit(1, reserved.slot.index, 1, MIB, 0, 0.0), Refused)
    assert isinstance(table.commit(0, reserved.slot.index, 1, 10 * reserved.slot.capacity,
                                   0, 0.0), Refused)


def test_a_state_that_grows_gets_a_new_region() -> None:
    table = SlotTable()
    first = table.reserve(0, 1, MIB)
    assert isinstance(first, Reserved) and first.grow
    table.commit(0, first.slot.index, 1, MIB, 0, 0.0)
    for step in (2, 3):
        saved(table, 0, step)
    again = table.reserve(0, 4, 64 * MIB)  # reuses slot 0, too small now
    assert isinstance(again, Reserved) and again.grow
    assert again.slot.capacity >= 64 * MIB
    assert again.slot.generation == first.slot.generation + 1
    assert again.slot.name != first.slot.name


def test_regions_are_whole_mib_and_no_bigger() -> None:
    assert region_size(1) == MIB
    assert region_size(100 * MIB) == 100 * MIB
    assert region_size(100 * MIB + 1) == 101 * MIB


def one_step_apart() -> SlotTable:
    """Two ranks, rank 0 at step 3 and rank 1 at step 2, each with its steps before."""
    table = SlotTable()
    table.decide(2)
    for step in (1, 2, 3):
        saved(table, 0, step)
    for step in (1, 2):
        saved(table, 1, step)
    return table


def test_ranks_one_step_apart_restore_the_common_step() -> None:
    table = one_step_apart()
    table.reserve(1, 3, MIB)  # rank 1 was killed in the middle of saving step 3
    restore = table.decide(2)
    assert restore is not None and restore.step == 2 and not restore.replicated
    assert {k: s.step for k, s in restore.slots.items()} == {0: 2, 1: 2}


def test_a_torn_save_is_never_restored() -> None:
    table = SlotTable()
    table.decide(1)
    saved(table, 0, 1)
    reserved = table.reserve(0, 2, MIB)
    assert isinstance(reserved, Reserved)
    restore = table.decide(1)
    assert restore is not None and restore.step == 1
    assert table.slots[0][reserved.slot.index].state is SlotState.FREE


def test_steps_newer_than_the_restored_one_are_dropped() -> None:
    """Rank 0's step 3 belongs to a timeline the job leaves: it must never be combined
    with the step 3 the restored run saves later."""
    table = one_step_apart()
    table.decide(2)
    assert steps(table, 0) == [1, 2]


def test_nothing_restored_drops_everything() -> None:
    table = SlotTable()
    table.decide(2)
    saved(table, 0, 1)  # rank 1 never saved
    assert table.decide(2) is None
    assert steps(table, 0) == []
    saved(table, 0, 0)  # a new timeline starts from its own steps


def test_saves_before_load_never_evict_the_restored_step() -> None:
    table = SlotTable()
    table.decide(1)
    for step in (1, 2, 3):
        saved(table, 0, step)
    restore = table.decide(1)
    assert restore is not None and restore.step == 3
    for step in range(4, 12):
        saved(table, 0, step)
        assert 3 in steps(table, 0)
        assert table.restore_for(0) is not None
    assert restore.slots[0].index not in [s.index for s in table.slots[0]
                                          if s.state is SlotState.WRITING]


def test_the_restored_step_is_the_floor_of_the_attempt() -> None:
    table = SlotTable()
    table.decide(1)
    saved(table, 0, 7)
    table.decide(1)
    refused = table.reserve(0, 3, MIB)  # a script that did not load starts again from 0
    assert isinstance(refused, Refused) and "7" in refused.reason


def test_a_slot_being_persisted_is_not_written() -> None:
    table = SlotTable()
    table.decide(1)
    first = saved(table, 0, 1)
    table.set_persisting(0, first, True)
    for step in range(2, 8):
        saved(table, 0, step)
    assert 1 in steps(table, 0)
    table.set_persisting(0, first, False)
    saved(table, 0, 8)
    assert 1 not in steps(table, 0)


def test_replicated_keeps_one_copy_the_other_ranks_are_told_it_is_held() -> None:
    table = SlotTable()
    table.decide(2)
    first = table.reserve(REPLICATED, 4, MIB)
    assert isinstance(first, Reserved)
    assert isinstance(table.reserve(REPLICATED, 4, MIB), Held)
    table.commit(REPLICATED, first.slot.index, 4, MIB, 0, 0.0)
    assert isinstance(table.reserve(REPLICATED, 4, MIB), Held)


def test_replicated_restores_under_another_world_size() -> None:
    table = SlotTable()
    table.decide(2)
    saved(table, REPLICATED, 9)
    restore = table.decide(3)
    assert restore is not None and restore.step == 9 and restore.replicated
    assert table.restore_for(2) is not None and table.restore_for(2) is table.restore_for(0)


def test_per_rank_snapshots_do_not_restore_under_another_world_size() -> None:
    table = SlotTable()
    table.decide(2)
    saved(table, 0, 1)
    saved(table, 1, 1)
    assert table.decide(1) is None


def test_choose_prefers_the_newest_complete_step() -> None:
    table = SlotTable()
    table.decide(2)
    for step in (1, 2):
        saved(table, 0, step)
        saved(table, 1, step)
    restore = choose(table.complete(), 2)
    assert restore is not None and restore.step == 2


def test_memory_counts_every_region() -> None:
    table = SlotTable()
    table.decide(1)
    for step in range(4):
        saved(table, 0, step, size=2 * MIB)
    assert table.memory() == 3 * region_size(2 * MIB)


def test_a_region_that_could_not_be_made_is_as_before() -> None:
    table = SlotTable()
    reserved = table.reserve(0, 1, MIB)
    assert isinstance(reserved, Reserved)
    table.abandon(reserved.slot, None)
    assert table.memory() == 0
    assert isinstance(table.reserve(0, 2, MIB), Reserved)


def test_the_restore_says_the_newest_step_saved_and_when_its_step_was_complete() -> None:
    table = one_step_apart()
    restore = table.decide(2)
    assert restore is not None and restore.newest == 3 and restore.saved_at == 2.0
    assert restore.source == "memory"


def test_forgetting_drops_every_complete_snapshot_and_the_restore() -> None:
    table = SlotTable()
    table.decide(1)
    saved(table, 0, 4)
    assert table.decide(1) is not None
    table.forget()
    assert table.restore is None and steps(table, 0) == []
    saved(table, 0, 0)  # a new timeline, from its own first step


def test_a_save_is_progress_for_readiness_and_goodput_but_not_liveness() -> None:
    from supervisor.core.statusview import ProgressTable

    table = ProgressTable()
    heard: list[tuple[int, int, float]] = []
    table.listeners.append(lambda attempt, rank, at: heard.append((attempt, rank, at)))
    table.reset(1)
    table.touch_save(0, 5.0)
    table.touch_save(0, 6.0)  # only the first per attempt is news
    assert heard == [(1, 0, 5.0)] and table.shown() == {0}
    assert table.view() == {}  # liveness judges deadline posts only
