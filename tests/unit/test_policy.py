"""Restart policy: budget, healing window, retryable codes, backoff with jitter."""

from __future__ import annotations

import random

from supervisor.core.policy import RestartHistory, RestartPolicy


def test_budget_counts_down_then_refuses() -> None:
    policy = RestartPolicy(max_restarts=2)
    h = RestartHistory()
    v1 = policy.decide(h, 1, 1.0, 0.5)
    v2 = policy.decide(v1.history, 1, 2.0, 0.5)
    v3 = policy.decide(v2.history, 1, 3.0, 0.5)
    assert (v1.restart, v1.budget_left) == (True, 1)
    assert (v2.restart, v2.budget_left) == (True, 0)
    assert not v3.restart and "budget exhausted (2/2 used)" in v3.reason


def test_budget_heals_after_a_healthy_window() -> None:
    policy = RestartPolicy(max_restarts=1, budget_window=600)
    v1 = policy.decide(RestartHistory(group_started_at=0.0), 1, 10.0, 0.0)
    assert v1.restart
    ran_long = v1.history.started(20.0)
    assert policy.decide(ran_long, 1, 20.0 + 600, 0.0).restart  # healed
    ran_short = v1.history.started(20.0)
    assert not policy.decide(ran_short, 1, 20.0 + 599, 0.0).restart


def test_non_retryable_exit_code_refuses_without_using_budget() -> None:
    policy = RestartPolicy(max_restarts=3, no_restart_exit_codes=frozenset({2}))
    v = policy.decide(RestartHistory(), 2, 1.0, 0.0)
    assert not v.restart and v.budget_left == 3 and "not retryable" in v.reason


def test_allow_list_only_retries_listed_codes() -> None:
    policy = RestartPolicy(max_restarts=3, restart_exit_codes=frozenset({75}))
    assert policy.decide(RestartHistory(), 75, 1.0, 0.0).restart
    assert not policy.decide(RestartHistory(), 1, 1.0, 0.0).restart
    assert policy.decide(RestartHistory(), None, 1.0, 0.0).restart  # killed by a signal


def test_backoff_grows_exponentially_within_full_jitter_bounds() -> None:
    policy = RestartPolicy(max_restarts=100, backoff_base=0.2, backoff_max=1.0)
    rng = random.Random(7)
    h = RestartHistory()
    ceilings = [0.2, 0.4, 0.8, 1.0, 1.0]
    for ceiling in ceilings:
        jitter = rng.random()
        v = policy.decide(h, 1, 0.0, jitter)
        assert 0.0 <= v.delay <= ceiling
        assert abs(v.delay - jitter * ceiling) < 1e-9
        h = v.history


def test_default_policy_restarts_immediately() -> None:
    v = RestartPolicy(max_restarts=1).decide(RestartHistory(), 1, 0.0, 0.9)
    assert v.restart and v.delay == 0.0
