"""The goodput accountant, fed scripted timestamps (pure; no event loop)."""

from __future__ import annotations

import pytest

from supervisor.core.goodput import (
    CAUSES,
    SIGNAL_NONE,
    SIGNAL_UNKNOWN,
    SIGNAL_YES,
    Accountant,
    Kind,
    Outcome,
    cause_of_membership,
    totals,
)

BOUND = 60.0


def started(ranks: tuple[int, ...] = (0, 1), at: float = 1.0) -> Accountant:
    """An accountant whose first attempt launched at ``at`` and progressed on every rank."""
    acc = Accountant(0.0, BOUND)
    acc.launched(1, ranks, at)
    for i, rank in enumerate(ranks):
        acc.progress(1, rank, at + 1.0 + i)
    return acc


def test_startup_lasts_until_every_rank_showed_progress() -> None:
    acc = Accountant(0.0, BOUND)
    assert acc.launched(1, (0, 1), 0.5) == []
    acc.progress(1, 0, 2.0)
    assert acc.ledger().kind is Kind.STARTUP
    assert acc.ledger().awaiting == (1,)
    acc.progress(1, 1, 3.0)
    t = totals(acc.ledger(), 10.0)
    assert t.startup == pytest.approx(3.0)
    assert t.productive == pytest.approx(7.0)
    assert t.lost == 0.0 and t.wall == pytest.approx(10.0)
    assert t.ratio == pytest.approx(0.7)


def test_crash_record_has_every_phase_and_the_lost_time() -> None:
    acc = started()  # productive from 3.0
    assert acc.failed("exit_code", 10.0, local_rank=1) == []
    acc.stopped(10.2)
    acc.counted(1)  # the state machine counted the restart (/status: 1 used)
    assert acc.launched(2, (0, 1), 10.5) == []
    assert acc.progress(2, 1, 12.0) == []
    (record,) = acc.progress(2, 0, 12.5)
    assert record.outcome is Outcome.RECOVERED
    assert record.cause == "exit_code" and record.local_rank == 1 and record.attempt == 1
    assert record.phases() == pytest.approx(
        {"detect": 0.0, "stop": 0.2, "relaunch": 0.3, "resume": 2.0}
    )
    assert record.lost == pytest.approx(2.5)
    assert record.awaited == (0, 1) and record.missing == () and record.no_signal == ()
    t = totals(acc.ledger(), 20.0)
    assert t.productive == pytest.approx((10.0 - 3.0) + (20.0 - 12.5))
    assert t.lost_by_cause["exit_code"] == pytest.approx(2.5)
    assert t.restarts == 1 and t.failures == 1
    assert t.startup + t.productive + t.lost + t.idle == pytest.approx(t.wall)


def test_hang_counts_from_the_ranks_last_progress() -> None:
    acc = started()
    acc.failed("hang", 70.0, local_rank=0, last_progress=9.0)
    acc.stopped(70.5)
    acc.launched(2, (0, 1), 71.0)
    acc.progress(2, 0, 72.0)
    (record,) = acc.progress(2, 1, 72.5)
    assert record.failed_at == 9.0
    assert record.phases()["detect"] == pytest.approx(61.0)
    assert record.lost == pytest.approx(63.5)
    t = totals(acc.ledger(), 72.5)
    assert t.productive == pytest.approx(9.0 - 3.0)
    assert t.lost_by_cause["hang"] == pytest.approx(63.5)


def test_a_hang_before_the_productive_segment_does_not_reach_into_accounted_time() -> None:
    acc = started()  # productive from 3.0 (rank 1's first progress)
    acc.failed("hang", 70.0, local_rank=0, last_progress=2.0)  # rank 0 posted once, at 2.0
    assert acc.ledger().last is not None
    assert acc.ledger().last.failed_at == 3.0


def test_start_up_excludes_nothing_after_a_failure_before_first_progress() -> None:
    acc = Accountant(0.0, BOUND)
    acc.launched(1, (0,), 1.0)
    acc.failed("signal", 4.0, local_rank=0)  # died importing, before any progress
    acc.stopped(4.1)
    acc.launched(2, (0,), 4.2)
    (record,) = acc.progress(2, 0, 6.0)  # still awaited: its signal was unknown
    assert record.lost == pytest.approx(2.0)
    t = totals(acc.ledger(), 6.0)
    assert t.startup == pytest.approx(4.0) and t.productive == 0.0


def test_a_second_failure_before_resumption_closes_the_first_as_failed_again() -> None:
    acc = started()
    acc.failed("exit_code", 10.0, local_rank=0)
    acc.stopped(10.1)
    acc.counted(1)
    acc.launched(2, (0, 1), 10.2)
    acc.progress(2, 0, 11.0)
    (first,) = acc.failed("signal", 12.0, local_rank=1)
    acc.counted(2)
    assert first.outcome is Outcome.FAILED_AGAIN
    assert first.resumed_at is None and first.lost == pytest.approx(2.0)
    acc.stopped(12.1)
    acc.launched(3, (0, 1), 12.2)
    acc.progress(3, 0, 13.0)
    (second,) = acc.progress(3, 1, 13.5)
    assert second.number == 2 and second.cause == "signal" and second.lost == pytest.approx(1.5)
    t = totals(acc.ledger(), 13.5)
    assert t.lost_by_cause["exit_code"] == pytest.approx(2.0)
    assert t.lost_by_cause["signal"] == pytest.approx(1.5)
    assert t.restarts == 2


def test_later_failures_of_a_stopping_attempt_are_ignored() -> None:
    acc = started()
    acc.failed("exit_code", 10.0, local_rank=0)
    assert acc.failed("signal", 10.05, local_rank=1) == []
    assert acc.ledger().failures == 1


def test_silent_rank_is_waited_for_until_the_bound_then_has_no_signal() -> None:
    acc = Accountant(0.0, 5.0)
    acc.launched(1, (0, 1), 1.0)
    acc.progress(1, 0, 2.0)
    assert acc.deadline() == pytest.approx(6.0)
    assert acc.poll(5.9) == []
    acc.poll(6.0)
    assert acc.signal_of(1) == SIGNAL_NONE and acc.signal_of(0) == SIGNAL_YES
    t = totals(acc.ledger(), 10.0)
    assert t.startup == pytest.approx(2.0)  # settled at the last first-progress seen
    assert t.productive == pytest.approx(8.0)
    # the next attempt does not wait for it, and the record says so
    acc.failed("exit_code", 10.0, local_rank=0)
    acc.stopped(10.1)
    acc.launched(2, (0, 1), 10.2)
    (record,) = acc.progress(2, 0, 11.0)
    assert record.awaited == (0,) and record.no_signal == (1,)


def test_no_rank_with_a_signal_leaves_the_resumption_unknown() -> None:
    """The newcomer's crash 'lost 0.2 s' for a 17 s gap: without a signal, no figure."""
    acc = Accountant(0.0, 5.0)
    acc.launched(1, (0,), 1.0)
    acc.poll(6.0)
    acc.failed("exit_code", 10.0, local_rank=0)
    acc.stopped(10.1)
    (record,) = acc.launched(2, (0,), 10.3)
    assert record.outcome is Outcome.UNKNOWN and record.resumed_at is None
    assert record.lost is None and record.lost_at_least == pytest.approx(0.3)
    assert record.no_signal == (0,) and record.phases()["resume"] is None
    t = totals(acc.ledger(), 20.0)
    assert t.startup == pytest.approx(1.0) and t.productive == 0.0
    assert t.unknown == pytest.approx(9.0 + 9.7) and t.lost == pytest.approx(0.3)
    assert t.ratio is None


def test_a_rank_that_had_progress_but_stays_silent_is_missing_not_signalless() -> None:
    acc = started(ranks=(0, 1))
    acc.failed("exit_code", 10.0, local_rank=1)
    acc.stopped(10.1)
    acc.launched(2, (0, 1), 10.2)
    acc.progress(2, 0, 11.0)
    (record,) = acc.poll(10.2 + BOUND)
    assert record.missing == (1,) and record.resumed_at == 11.0
    assert acc.signal_of(1) == SIGNAL_YES


def test_membership_change_is_a_record_of_its_own_cause() -> None:
    acc = started()
    acc.failed(cause_of_membership("node(s) lost: b"), 20.0)
    acc.stopped(20.1)
    acc.launched(2, (0, 1), 21.0)
    acc.progress(2, 0, 21.5)
    (record,) = acc.progress(2, 1, 21.6)
    assert record.cause == "node_lost" and record.local_rank is None
    assert totals(acc.ledger(), 22.0).lost_by_cause["node_lost"] == pytest.approx(1.6)


def test_job_that_fails_for_good_ends_its_record_unrecovered() -> None:
    acc = started()
    acc.failed("exit_code", 10.0, local_rank=0)
    acc.stopped(10.1)
    (record,) = acc.finished(10.2)
    assert record.outcome is Outcome.ENDED and record.lost == pytest.approx(0.2)
    assert record.stopped_at == 10.1 and record.launched_at is None
    t = totals(acc.ledger(), 100.0)  # nothing accrues after the end
    assert t.wall == pytest.approx(10.2)
    assert acc.finished(11.0) == [] and acc.failed("signal", 12.0) == []


def test_success_settles_an_unfinished_start_up_and_leaves_the_barrier_idle() -> None:
    acc = Accountant(0.0, BOUND)
    acc.launched(1, (0, 1), 1.0)
    acc.progress(1, 0, 2.0)  # rank 1 never showed progress before the job finished
    assert acc.paused(5.0, settle=True) == []
    acc.finished(6.0)
    t = totals(acc.ledger(), 6.0)
    assert t.startup == pytest.approx(2.0)
    assert t.productive == pytest.approx(3.0)
    assert t.idle == pytest.approx(1.0)


def test_shutdown_during_a_recovery_ends_it_unrecovered() -> None:
    acc = started()
    acc.failed("exit_code", 10.0, local_rank=0)
    acc.stopped(10.1)
    acc.launched(2, (0, 1), 10.2)
    (record,) = acc.paused(11.0, settle=False)
    assert record.outcome is Outcome.ENDED and record.lost == pytest.approx(1.0)


def test_progress_of_another_attempt_or_unknown_rank_is_ignored() -> None:
    acc = Accountant(0.0, BOUND)
    acc.launched(2, (0,), 1.0)
    assert acc.progress(1, 0, 1.5) == []
    assert acc.progress(2, 7, 1.5) == []
    assert acc.signal_of(7) == SIGNAL_UNKNOWN
    assert acc.ledger().kind is Kind.STARTUP


def test_open_recovery_counts_as_lost_up_to_now() -> None:
    acc = started()
    acc.failed("dstate", 30.0, local_rank=0, last_progress=25.0)
    t = totals(acc.ledger(), 40.0)
    assert t.lost_by_cause["dstate"] == pytest.approx(15.0)
    assert acc.ledger().last is not None and acc.ledger().last.outcome is Outcome.OPEN


def test_unknown_cause_is_accounted_as_other_and_every_cause_has_a_total() -> None:
    acc = started()
    acc.failed("cosmic ray", 10.0)
    t = totals(acc.ledger(), 11.0)
    assert set(t.lost_by_cause) == set(CAUSES)
    assert t.lost_by_cause["other"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("reason", "cause"),
    [
        ("node(s) lost: host-b:1:ab", "node_lost"),
        ("node(s) waiting to join: host-c:2:cd", "node_joined"),
        ("round 4 was opened by another node", "remote_failure"),
        ("job closed: node x failed", "remote_failure"),
        ("rendezvous lost: lease expired", "other"),
        ("cut off from etcd: peer b runs round 1, this node round 0: the job went on "
         "without it", "node_lost"),
    ],
)
def test_membership_reasons_map_to_causes(reason: str, cause: str) -> None:
    assert cause_of_membership(reason) == cause


def test_without_any_progress_the_figures_are_unknown_and_the_restarts_are_the_budgets() -> None:
    """Issue 53: a job with no progress signal is not "0 % productive", and the goodput
    line's restart count is the one /status shows as used (a restart decided and not yet
    launched counts; a membership change's relaunch does not)."""
    acc = Accountant(0.0, 5.0)
    acc.launched(1, (0,), 1.0)
    acc.failed("exit_code", 3.0, local_rank=0)
    acc.stopped(3.1)
    acc.counted(1)  # decided: the relaunch has not happened yet
    t = totals(acc.ledger(), 4.0)
    assert not t.seen and not t.known and t.ratio is None
    assert t.restarts == 1 and t.failures == 1
    acc.launched(2, (0,), 4.0)
    acc.progress(2, 0, 5.0)  # a signal at last: figures from here on can be known
    t = totals(acc.ledger(), 6.0)
    assert t.seen and t.restarts == 1
