"""Restart policy end to end: backoff, non-retryable codes, stopping during a backoff."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from tests.support.daemon import supervisor
from tests.support.paths import FAKE_WORKER


def events(log_dir: Path) -> list[dict[str, object]]:
    lines = (log_dir / "none" / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


async def test_crash_loop_backoff_ceilings_grow_and_are_waited(tmp_path: Path) -> None:
    args = ["--health-port", "0", "--max-restarts", "4", "--restart-backoff", "0.2:1",
            "--log-dir", str(tmp_path), FAKE_WORKER, "--exit", "9"]
    async with supervisor(args) as sup:
        assert await sup.wait(timeout=60) == 9
    evs = events(tmp_path)
    scheduled = [e for e in evs if e["event"] == "restart_scheduled"]
    assert [e["ceiling"] for e in scheduled] == [0.2, 0.4, 0.8, 1.0]
    for e in scheduled:
        assert 0.0 <= float(e["delay"]) <= float(e["ceiling"])  # type: ignore[arg-type]
    # each relaunch came no earlier than its scheduled delay
    stopped = [float(e["mono"]) for e in evs if e["event"] == "group_stopped"]  # type: ignore[arg-type]
    started = [float(e["mono"]) for e in evs if e["event"] == "group_started"]  # type: ignore[arg-type]
    for stop, start, e in zip(stopped, started[1:], scheduled, strict=False):
        assert start - stop >= float(e["delay"]) - 0.002  # type: ignore[arg-type]
    refused = [e for e in evs if e["event"] == "restart_refused"]
    assert len(refused) == 1 and "budget exhausted (4/4 used)" in str(refused[0]["reason"])


async def test_non_retryable_exit_code_ends_at_once_with_budget_untouched(tmp_path: Path) -> None:
    args = ["--health-port", "0", "--max-restarts", "5", "--no-restart-exit-codes", "3,4",
            "--log-dir", str(tmp_path), FAKE_WORKER, "--exit", "4"]
    async with supervisor(args) as sup:
        assert await sup.wait() == 4
        await sup.err.expect(r"exit code 4 is not retryable")
    evs = events(tmp_path)
    assert [e["event"] for e in evs].count("group_started") == 1
    assert evs[-1]["restart_count"] == 0


async def test_sigterm_during_backoff_stops_at_once(tmp_path: Path) -> None:
    args = ["--health-port", "0", "--max-restarts", "3", "--restart-backoff", "30:30",
            "--shutdown-timeout", "2", "--log-dir", str(tmp_path), FAKE_WORKER, "--exit", "1"]
    async with supervisor(args) as sup:
        await sup.err.expect(r"stopping -> backoff")
        started = time.monotonic()
        sup.signal(signal.SIGTERM)
        assert await sup.wait(timeout=10) == 128 + signal.SIGTERM
        assert time.monotonic() - started < 2.0  # well inside the shutdown timeout
    states = [(e["old"], e["new"]) for e in events(tmp_path) if e["event"] == "state"]
    # the stop came from BACKOFF (full jitter drew a delay in [0, 30] s: < 0.05 s in 0.2 %)
    assert ("backoff", "stopping") in states
    assert [e["event"] for e in events(tmp_path)].count("group_started") == 1
