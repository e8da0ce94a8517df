"""Pure health verdicts and the status document, from constructed snapshots."""

from __future__ import annotations

import json

import msgspec
import pytest
from msgspec.structs import replace

from supervisor import __version__
from supervisor.core.health import (
    DEFAULT_MAX_LOOP_LAG,
    Verdict,
    liveness,
    readiness,
    ready_and_live,
    stale_ranks,
    status_document,
)
from supervisor.core.state import Phase
from supervisor.core.statusview import FailureView, RendezvousView, StatusView, WorkerView

NOW = 1000.0


def make_status_view(phase: str = "running", **changes: object) -> StatusView:
    workers = tuple(
        WorkerView(local_rank=i, global_rank=4 + i, pid=100 + i, state="running", started_at=5.0)
        for i in range(2)
    )
    snap = StatusView(
        run_id="job-1",
        phase=phase,
        attempt=3,
        restart_count=2,
        max_restarts=5,
        restarts_left=3,
        world_size=8,
        local_world_size=2,
        role="trainer",
        published_at=NOW - 1.0,
        started_at_wall=1_700_000_000.0,
        workers=workers,
        rendezvous=RendezvousView("static", round=4, members=("a", "b"), group_rank=2,
                                  group_world_size=4, last_duration=0.25),
        watchdog_enabled=True,
        progress_timeout=60.0,
    )
    return replace(snap, **changes)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- liveness


def test_live_with_no_progress_reported() -> None:
    assert liveness(make_status_view(), {}, NOW, 0.0).ok


def test_live_with_recent_progress() -> None:
    assert liveness(make_status_view(), {0: NOW - 59.0, 1: NOW - 1.0}, NOW, 0.0).ok


def test_not_live_when_a_running_rank_is_stale() -> None:
    verdict = liveness(make_status_view(), {0: NOW - 1.0, 1: NOW - 61.0}, NOW, 0.0)
    assert not verdict.ok
    assert "local rank 1" in verdict.reason
    assert "61.0 s" in verdict.reason


def test_stale_reason_names_the_oldest_rank_and_counts_the_others() -> None:
    verdict = liveness(make_status_view(), {0: NOW - 70.0, 1: NOW - 90.0}, NOW, 0.0)
    assert "local rank 1" in verdict.reason
    assert "1 more" in verdict.reason


def test_rank_that_never_posted_is_not_judged() -> None:
    # rank 1 never posted; rank 0 is fresh
    assert liveness(make_status_view(), {0: NOW}, NOW, 0.0).ok


def test_finished_rank_is_not_judged() -> None:
    snap = make_status_view()
    done = replace(snap.workers[1], state="succeeded", exit_code=0)
    snap = replace(snap, workers=(snap.workers[0], done))
    assert liveness(snap, {0: NOW, 1: NOW - 500.0}, NOW, 0.0).ok


@pytest.mark.parametrize(
    "phase", ["rendezvous", "starting", "stopping", "backoff", "exit_barrier", "succeeded"]
)
def test_stale_progress_is_not_judged_outside_running(phase: str) -> None:
    assert liveness(make_status_view(phase), {0: NOW - 500.0}, NOW, 0.0).ok


def test_non_positive_progress_timeout_disables_progress_check() -> None:
    snap = make_status_view(progress_timeout=0.0)
    assert liveness(snap, {0: NOW - 500.0}, NOW, 0.0).ok


def test_not_live_when_loop_lag_exceeds_bound() -> None:
    verdict = liveness(make_status_view("rendezvous"), {}, NOW, DEFAULT_MAX_LOOP_LAG + 0.1)
    assert not verdict.ok
    assert "event loop lag" in verdict.reason


def test_loop_lag_bound_is_configurable() -> None:
    assert not liveness(make_status_view(), {}, NOW, 0.5, max_loop_lag=0.2).ok
    assert liveness(make_status_view(), {}, NOW, 0.1, max_loop_lag=0.2).ok


def test_stale_ranks_sorted_oldest_first() -> None:
    ranks = stale_ranks(make_status_view(), {0: NOW - 70.0, 1: NOW - 90.0}, NOW)
    assert [r for r, _ in ranks] == [1, 0]


# --------------------------------------------------------------------------- readiness


def test_ready_while_running() -> None:
    assert readiness(make_status_view()) == Verdict(True, "running")


@pytest.mark.parametrize("phase", [p.value for p in Phase if p is not Phase.RUNNING])
def test_not_ready_outside_running(phase: str) -> None:
    verdict = readiness(make_status_view(phase))
    assert not verdict.ok
    assert phase in verdict.reason


def test_not_ready_with_a_failed_worker() -> None:
    snap = make_status_view()
    failed = replace(snap.workers[0], state="failed", exit_code=3)
    assert not readiness(replace(snap, workers=(failed, snap.workers[1]))).ok


def test_ready_while_some_ranks_already_succeeded() -> None:
    snap = make_status_view()
    done = replace(snap.workers[0], state="succeeded", exit_code=0)
    assert readiness(replace(snap, workers=(done, snap.workers[1]))).ok


def test_ready_and_live_fails_when_progress_is_stale() -> None:
    verdict = ready_and_live(make_status_view(), {0: NOW - 100.0}, NOW, 0.0)
    assert not verdict.ok
    assert "no progress" in verdict.reason


def test_ready_and_live_reports_readiness_reason_first() -> None:
    verdict = ready_and_live(make_status_view("backoff"), {}, NOW, 100.0)
    assert verdict.reason == "not running: backoff"


def test_verdict_json_body() -> None:
    assert Verdict(False, "x").as_json() == {"ok": False, "reason": "x"}


# ------------------------------------------------------------------------------ status


def test_status_document_core_fields() -> None:
    doc = status_document(make_status_view(), {}, NOW, now_wall=1_700_000_100.0)
    assert doc["run_id"] == "job-1"
    assert doc["node_rank"] == 2
    assert doc["group_world_size"] == 4
    assert doc["state"] == "running"
    assert doc["attempt"] == 3
    assert doc["restarts"] == {"used": 2, "max": 5, "left": 3}
    assert doc["world_size"] == 8
    assert doc["version"] == __version__
    assert doc["uptime"] == 100.0
    assert doc["snapshot_age"] == 1.0


def test_status_document_workers_with_progress_age() -> None:
    doc = status_document(make_status_view(), {1: NOW - 2.5}, NOW)
    w0, w1 = doc["workers"]
    assert (w0["local_rank"], w0["global_rank"], w0["pid"], w0["state"]) == (0, 4, 100, "running")
    assert w0["last_progress_age"] is None
    assert w1["last_progress_age"] == 2.5


def test_status_document_rendezvous() -> None:
    doc = status_document(make_status_view(), {}, NOW)
    assert doc["rendezvous"] == {
        "backend": "static", "round": 4, "members": ["a", "b"], "group_rank": 2,
        "group_world_size": 4, "duration": 0.25, "etcd": None,
    }


def test_status_document_last_failure_root_cause() -> None:
    failure = FailureView(
        kind="exited", attempt=2, local_rank=1, global_rank=5, pid=101, exit_code=3,
        signal=None, message="boom", description="local rank 1 (pid 101) exited with code 3",
        at_wall=1_700_000_050.0,
    )
    doc = status_document(make_status_view(last_failure=failure), {}, NOW)
    assert doc["last_failure"]["description"].startswith("local rank 1")
    assert doc["last_failure"]["exit_code"] == 3
    assert doc["last_failure"]["global_rank"] == 5


def test_status_document_without_wall_clock_has_null_uptime() -> None:
    assert status_document(make_status_view(), {}, NOW)["uptime"] is None


def test_status_document_is_json_serialisable_and_small() -> None:
    text = json.dumps(status_document(make_status_view(), {0: NOW}, NOW, now_wall=0.0))
    assert len(text) < 4096


def test_status_document_exposes_no_environment_or_command() -> None:
    text = json.dumps(status_document(make_status_view(), {}, NOW)).lower()
    for word in ("environ", "env", "argv", "command", "cmd", "secret", "token", "password"):
        assert f'"{word}' not in text


def test_status_document_shows_the_etcd_outage_view() -> None:
    """The etcd backends' reachability and outages reach /status as the app gives them."""
    view = {"reachable": False, "unreachable_for": 3.5, "outages": 2, "last_outage": 12.0,
            "total_outage": 15.5, "cause": "no answer", "outage_limit": None}
    snap = make_status_view()
    snap = msgspec.structs.replace(
        snap, rendezvous=msgspec.structs.replace(snap.rendezvous, etcd=view))
    assert status_document(snap, {}, NOW)["rendezvous"]["etcd"] == view
