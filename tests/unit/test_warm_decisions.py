"""Warm restarts' decisions (``core.warm``): when standbys come and how, which ranks get
one and from where, why a rank starts cold, when a warm rank waits for rank 0's store,
how long a restart waits for a fork server still importing."""

from __future__ import annotations

import pytest

from supervisor.core import warm
from supervisor.core.warm import Supply


@pytest.mark.parametrize(("count", "max_restarts", "elastic", "follows"), [
    (0, 0, False, False),  # the only attempt
    (0, 1, False, True),
    (1, 1, False, False),  # the budget is spent
    (5, 1, True, True),  # a membership change may always bring another
])
def test_standbys_are_worth_their_memory_only_if_an_attempt_may_follow(
        count: int, max_restarts: int, elastic: bool, follows: bool) -> None:
    assert warm.attempt_may_follow(count, max_restarts, elastic) is follows


def test_standbys_that_import_for_themselves_wait_until_the_ranks_resumed() -> None:
    assert not warm.plan_at_launch(True, preloading=True, forking=False)
    assert warm.supply_after_launch(True, planned=False, forking=False) is Supply.WHEN_RESUMED


def test_forked_or_plain_standbys_are_planned_at_the_launch_itself() -> None:
    assert warm.plan_at_launch(True, preloading=True, forking=True)
    assert warm.plan_at_launch(True, preloading=False, forking=False)
    assert warm.supply_after_launch(True, planned=True, forking=True) is Supply.FORK
    assert warm.supply_after_launch(True, planned=True, forking=False) is Supply.START


def test_no_standby_when_no_attempt_may_follow() -> None:
    assert not warm.plan_at_launch(False, preloading=False, forking=False)
    assert warm.supply_after_launch(False, planned=False, forking=True) is Supply.NONE


def test_a_fork_server_given_up_after_the_launch_means_started_standbys() -> None:
    planned = warm.plan_at_launch(True, preloading=True, forking=True)
    assert warm.supply_after_launch(True, planned, forking=False) is Supply.START


def test_ranks_that_hold_a_standby_or_cannot_run_warm_get_none() -> None:
    runs_warm = [(0, True), (1, True), (2, False), (3, True)]
    assert warm.ranks_wanting(runs_warm, held={1}) == [0, 3]


def test_a_rank_whose_environment_is_not_the_nodes_gets_a_started_standby() -> None:
    node = {"PATH": "/bin", "LOCAL_RANK": "0"}
    envs = [(0, {"PATH": "/bin", "LOCAL_RANK": "0"}), (1, {"PATH": "/bin", "LOCAL_RANK": "1"}),
            (2, {"PATH": "/usr/bin", "LOCAL_RANK": "2"})]
    assert warm.split_by_source(envs, True, node) == ([0, 1], [2])


def test_without_a_ready_server_a_forking_pool_starts_no_standby() -> None:
    assert warm.split_by_source([(0, {})], True, None) == ([], [])


def test_without_the_fork_server_every_standby_is_started() -> None:
    assert warm.split_by_source([(0, {}), (1, {})], False, {"A": "1"}) == ([], [0, 1])


def test_why_a_standby_cannot_take_its_worker_in_order() -> None:
    assert warm.cold_reason(False, "X", "boom") == (
        "other", "its command cannot run in a standby")
    assert warm.cold_reason(True, "X", "boom") == (
        "env_changed", "environment variable X changed since its standby started")
    assert warm.cold_reason(True, None, "boom") == ("preload_failed", "boom")
    assert warm.cold_reason(True, None, None) is None


def test_warm_ranks_other_than_0_wait_for_rank_0s_store_on_its_node_once_seen() -> None:
    master = ("10.0.0.1", 29500)
    assert warm.store_to_await(True, 0, 1, master) == ("10.0.0.1", 29500, warm.STORE_WAIT)
    assert warm.store_to_await(True, 0, 0, master) is None  # rank 0 serves it
    assert warm.store_to_await(True, 8, 9, master) is None  # not rank 0's node
    assert warm.store_to_await(False, 0, 1, master) is None  # no store seen yet


def test_a_restart_waits_for_an_importing_server_as_long_as_a_cold_start_takes() -> None:
    assert warm.settle_wait(12.0, 30.0) == (12.0, True)
    assert warm.settle_wait(None, 30.0) == (30.0, True)  # the last import's time
    assert warm.settle_wait(None, None) == (warm.UNKNOWN_COLD_WAIT, False)


def test_a_cold_start_is_timed_once_every_cold_rank_progressed() -> None:
    assert warm.cold_startup_seen(True, 2, 2)
    assert not warm.cold_startup_seen(True, 2, 1)
    assert not warm.cold_startup_seen(False, 2, 2)  # some ranks ran warm
    assert not warm.cold_startup_seen(True, 0, 0)


def test_standbys_forked_by_an_earlier_server_are_stale() -> None:
    assert warm.stale_forks({0: 100, 1: 200, 2: 100}, 200) == [0, 2]
    assert warm.stale_forks({0: 100}, None) == [0]


def test_reasons_learned_during_an_attempt_are_the_next_attempts() -> None:
    reasons = warm.ColdReasons()
    reasons.note(1, "preload_failed")
    assert reasons.reason(1, preload_failing=False) is None
    reasons.begin()
    assert reasons.reason(1, preload_failing=False) == "preload_failed"
    reasons.begin()
    assert reasons.reason(1, preload_failing=False) is None


def test_a_failing_fork_server_explains_a_rank_without_a_standby() -> None:
    reasons = warm.ColdReasons()
    reasons.begin()
    assert reasons.reason(0, preload_failing=True) == "preload_failed"
    reasons.current[0] = "env_changed"
    assert reasons.reason(0, preload_failing=True) == "env_changed"


def test_standbys_waiting_on_a_failed_preload_are_counted_once() -> None:
    reasons = warm.ColdReasons()
    reasons.begin([0, 1])  # an attempt began while they waited for a new server
    assert reasons.reason(1, preload_failing=False) == "preload_failed"
    reasons.preload_failed([0, 1])  # that server failed too: counted already
    reasons.begin()
    assert reasons.reason(1, preload_failing=False) is None


def test_a_failed_preload_not_counted_early_is_the_next_attempts_reason() -> None:
    reasons = warm.ColdReasons()
    reasons.preload_failed([2])
    reasons.begin()
    assert reasons.reason(2, preload_failing=False) == "preload_failed"


def test_a_tainted_rank_gets_at_most_three_new_standbys() -> None:
    retries = warm.TaintRetries()
    assert [retries.allow(0) for _ in range(4)] == [True, True, True, False]
    assert retries.allow(1)
