"""Readiness that waits for progress, and goodput in /status, /metrics and ``status``.

Pure verdicts with scripted snapshots; the rendering through a real health server.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import anyio
from prometheus_client.parser import text_string_to_metric_families

from supervisor.core import health
from supervisor.core.goodput import CAUSES, Accountant, Ledger, totals
from supervisor.core.statusview import ProgressTable, StatusView, WorkerView
from supervisor.health.metrics import Metrics
from supervisor.health.server import serve_health
from supervisor.statuscmd import format_status


def snapshot(
    ready_when: str = "progress", *, phase: str = "running", ledger: Ledger | None = None,
    timeout: float = 60.0,
) -> StatusView:
    workers = tuple(
        WorkerView(local_rank=r, global_rank=r, pid=100 + r, state="running", started_at=1.0)
        for r in (0, 1)
    )
    return StatusView(
        run_id="job", phase=phase, attempt=2, restart_count=1, max_restarts=3,
        restarts_left=2, world_size=2, local_world_size=2, role="default",
        published_at=10.0, started_at_wall=time.time(), workers=workers,
        progress_timeout=timeout, ready_when=ready_when, goodput=ledger,
    )


def launched_ledger(at: float) -> Ledger:
    acc = Accountant(0.0, 60.0)
    acc.launched(1, (0, 1), at)
    return acc.ledger()


# ------------------------------------------------------------------ readiness (pure)


def test_progress_mode_waits_for_ranks_that_progressed_in_an_earlier_attempt() -> None:
    snap = snapshot(ledger=launched_ledger(10.0))
    waiting = health.readiness(snap, shown={0}, expected={0, 1}, now_mono=11.0)
    assert not waiting.ok and "local rank(s) 1" in waiting.reason
    assert health.readiness(snap, shown={0, 1}, expected={0, 1}, now_mono=11.0).ok


def test_rank_never_seen_progressing_is_ready_at_launch() -> None:
    snap = snapshot(ledger=launched_ledger(10.0))
    assert health.readiness(snap, shown=set(), expected=set(), now_mono=10.0).ok


def test_the_wait_is_bounded_by_the_progress_timeout() -> None:
    snap = snapshot(ledger=launched_ledger(10.0), timeout=5.0)
    assert not health.readiness(snap, shown=set(), expected={0}, now_mono=14.9).ok
    assert health.readiness(snap, shown=set(), expected={0}, now_mono=15.0).ok


def test_launched_mode_is_ready_at_launch() -> None:
    snap = snapshot("launched", ledger=launched_ledger(10.0))
    assert health.readiness(snap, shown=set(), expected={0, 1}, now_mono=11.0).ok


def test_not_ready_once_a_failure_is_noticed() -> None:
    snap = snapshot(phase="stopping", ledger=launched_ledger(10.0))
    assert not health.readiness(snap, shown={0, 1}, expected={0, 1}, now_mono=11.0).ok


def test_progress_table_expects_what_earlier_attempts_showed() -> None:
    heard: list[tuple[int, int, float]] = []
    table = ProgressTable()
    table.listeners.append(lambda attempt, rank, at: heard.append((attempt, rank, at)))
    table.reset(1)
    table.touch_output(0, 1.0)  # a first line counts for a rank that posts no deadline
    table.touch(1, 2.0)
    table.touch(1, 3.0)  # only the first progress per attempt is heard
    assert heard == [(1, 0, 1.0), (1, 1, 2.0)]
    assert table.view() == {1: 3.0}  # a printed line never ages into a liveness failure
    table.reset(2)
    assert table.expected == {0, 1} and table.shown() == set()
    table.touch_output(1, 4.0)  # rank 1 posts deadlines: its output is not progress
    table.touch_output(0, 4.5)
    assert table.shown() == {0} and table.last_progress(0) == 4.5


# ------------------------------------------------------------------ rendering


def test_status_document_has_goodput_and_readiness() -> None:
    acc = Accountant(0.0, 60.0)
    acc.launched(1, (0, 1), 1.0)
    acc.progress(1, 0, 2.0)
    acc.progress(1, 1, 3.0)
    acc.failed("exit_code", 8.0, local_rank=1)
    acc.stopped(8.5)
    acc.counted(1)  # the state machine's count: /status's "used"
    acc.launched(2, (0, 1), 9.0)
    snap = snapshot(ledger=acc.ledger())
    doc = health.status_document(snap, {}, 10.0, now_wall=1000.0, shown={0},
                                 expected={0, 1})
    assert doc["readiness"] == {"ready_when": "progress", "awaiting_progress": [1]}
    g = doc["goodput"]
    assert g["segment"] == "lost" and g["productive"] == 5.0 and g["startup"] == 3.0
    assert g["lost_by_cause"]["exit_code"] == 2.0 and set(g["lost_by_cause"]) == set(CAUSES)
    assert g["ratio"] == 0.5 and g["failures"] == 1 and g["restarts"] == 1
    last = g["last_recovery"]
    assert last["outcome"] == "open" and last["failed_at"] == 998.0  # wall clock
    assert last["phases"] == {"detect": 0.0, "stop": 0.5, "relaunch": 0.5, "resume": None}
    text = format_status(doc)
    assert "ready when  progress, waiting for progress from local rank(s) 1" in text
    assert "goodput     50.0% productive of 10.0s wall" in text
    assert "exit_code  2.0s" in text
    assert "last loss   failure 1 (exit_code, attempt 1): open" in text


def test_without_a_progress_signal_status_says_unknown_not_zero() -> None:
    """Issue 53: `status` said "goodput 0.0% productive" while the job trained."""
    acc = Accountant(0.0, 60.0)
    acc.launched(1, (0, 1), 1.0)
    acc.failed("exit_code", 8.0, local_rank=1)
    acc.stopped(8.5)
    acc.counted(1)
    doc = health.status_document(snapshot(ledger=acc.ledger()), {}, 10.0, now_wall=1000.0)
    g = doc["goodput"]
    assert {g[k] for k in ("startup", "productive", "lost", "lost_by_cause", "ratio")} == {
        "unknown"}
    assert g["wall"] == 10.0 and g["restarts"] == 1 and g["failures"] == 1
    text = format_status(doc)
    assert "goodput     unknown (no progress signal: see --progress-pattern) over 10.0s wall" \
        in text and "1 restart(s)" in text
    assert "0.0%" not in text


@asynccontextmanager
async def served(snap: StatusView, progress: ProgressTable) -> AsyncIterator[str]:
    async with anyio.create_task_group() as tg:
        _, port = await tg.start(
            serve_health, "127.0.0.1", 0, lambda: snap, progress, Metrics(), lambda: 0.0
        )
        yield f"http://127.0.0.1:{port}"
        tg.cancel_scope.cancel()


async def scrape(snap: StatusView, progress: ProgressTable) -> tuple[
        dict[tuple[str, tuple[tuple[str, str], ...]], float], int, str]:
    """``/metrics`` as samples, and ``/readyz``'s status and body."""
    async with served(snap, progress) as base, aiohttp.ClientSession() as http:
        async with http.get(base + "/metrics") as resp:
            text = await resp.text()
        async with http.get(base + "/readyz") as resp:
            ready, body = resp.status, await resp.text()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }
    return samples, ready, body


async def test_metrics_have_every_cause_at_zero_once_a_rank_progressed() -> None:
    progress = ProgressTable()
    progress.reset(1)
    acc = Accountant(0.0, 60.0)
    now = time.monotonic()
    acc.launched(1, (0, 1), now)
    acc.progress(1, 0, now)
    samples, ready, _ = await scrape(snapshot(ledger=acc.ledger()), progress)
    assert ready == 200  # nothing expected yet: ready at launch
    for cause in CAUSES:
        assert samples[("elastic_supervisor_lost_seconds_total", (("cause", cause),))] == 0.0
        assert ("elastic_supervisor_recovery_seconds_count", (("cause", cause),)) in samples
    assert ("elastic_supervisor_productive_seconds_total", ()) in samples
    assert samples[("elastic_supervisor_ready", ())] == 1.0
    assert samples[("elastic_supervisor_awaiting_progress_ranks", ())] == 0.0


async def test_without_a_progress_signal_the_figures_are_absent_and_ready_says_why() -> None:
    """Issue 53: absent, not 0 (a dashboard says "no data", no alert on a job that cannot
    be measured); /readyz is 200 at launch and its body says that is all it means."""
    progress = ProgressTable()
    progress.reset(1)
    samples, ready, body = await scrape(snapshot(ledger=launched_ledger(time.monotonic())),
                                        progress)
    names = {name for name, _ in samples}
    for absent in ("productive_seconds_total", "startup_seconds_total", "lost_seconds_total",
                   "goodput_ratio"):
        assert f"elastic_supervisor_{absent}" not in names, absent
    assert "elastic_supervisor_wall_seconds_total" in names
    assert "elastic_supervisor_unknown_seconds_total" in names
    assert ready == 200 and "no rank has shown progress: ready at launch" in body


def test_goodput_counters_never_go_down_when_a_hang_is_accounted_after_the_fact() -> None:
    metrics = Metrics()
    acc = Accountant(0.0, 60.0)
    acc.launched(1, (0,), 1.0)
    acc.progress(1, 0, 2.0)

    def productive(now: float) -> float:
        metrics.goodput.observe(acc.ledger(), now)
        families = text_string_to_metric_families(metrics.render().decode())
        (value,) = [s.value for f in families for s in f.samples
                    if s.name == "elastic_supervisor_productive_seconds_total"]
        return value

    assert productive(10.0) == 8.0
    acc.failed("hang", 10.0, local_rank=0, last_progress=7.0)  # lost since 7.0, not 10.0
    assert totals(acc.ledger(), 10.0).productive == 5.0  # the truth, in /status
    assert productive(10.0) == 8.0  # the counter stays, and catches up later
    acc.stopped(10.5)
    acc.launched(2, (0,), 11.0)
    acc.progress(2, 0, 12.0)
    assert productive(14.0) == 8.0
    assert productive(16.0) == 9.0
