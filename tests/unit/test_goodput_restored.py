"""Goodput's failure records say what a relaunch restored from a snapshot."""

from __future__ import annotations

from supervisor.core.goodput import Accountant


def test_a_failure_record_carries_the_restored_step_and_the_work_lost() -> None:
    acc = Accountant(0.0, bound=10.0)
    acc.launched(1, [0, 1], 1.0)
    acc.progress(1, 0, 2.0)
    acc.progress(1, 1, 2.0)
    acc.failed("exit_code", 20.0, local_rank=1)
    acc.stopped(20.5)
    acc.restored(35, newest=36, saved_at=18.0, source="memory")
    acc.launched(2, [0, 1], 21.0)
    closed = acc.progress(2, 0, 22.0) + acc.progress(2, 1, 22.5)
    (record,) = closed
    assert record.restored_step == 35 and record.steps_redone == 1
    assert record.work_lost == 2.0 and record.state_from == "memory"


def test_nothing_is_recorded_without_a_failure() -> None:
    acc = Accountant(0.0, bound=10.0)
    acc.restored(3, newest=3, saved_at=None, source="disk")  # a run resumed from disk
    assert acc.ledger().last is None
