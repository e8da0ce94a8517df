"""The progress rule on a real torch job (gloo, CPU, no deadline posts): a line printed
while a rank starts is not progress; a line matching ``--progress-pattern`` is; without
either the goodput record says "unknown" instead of a figure (supervisor.core.goodput)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support import deps
from tests.support.daemon import supervisor
from tests.support.paths import TESTS

deps.need_module("torch")  # skips with how to install it (fails under .ci/run)
pytestmark = pytest.mark.torch

WORKER = str(TESTS / "workers" / "torch_steps.py")
TOLERANCE = 0.5  # s: the supervisor reads lines late on a loaded 2-core machine


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def run_job(tmp_path: Path, *extra: str) -> tuple[dict[str, Any], list[dict[str, Any]],
                                                        str]:
    events, wlog = tmp_path / "events.jsonl", tmp_path / "workers.jsonl"
    args = ["--health-port=0", "--nproc-per-node=2", "--max-restarts=1", "--tee=3",
            "--no-warm-restart", f"--event-log={events}", f"--log-dir={tmp_path / 'logs'}",
            *extra, WORKER, str(wlog), "--crash-rank", "1"]
    async with supervisor(args, env={"PYTHONPATH": str(TESTS.parent)}) as sup:
        assert await sup.wait(timeout=180) == 0, sup.err.text()
    (record,) = [e for e in read_jsonl(events) if e["event"] == "recovered"]
    return record, read_jsonl(wlog), sup.err.text()


async def test_without_a_signal_the_recovery_is_unknown(tmp_path: Path) -> None:
    record, _, log = await run_job(tmp_path, "--progress-timeout=3")
    assert record["recovered"] == "unknown" and record["phases"]["resume"] == "unknown"
    assert record["lost"] == "unknown" and record["lost_at_least"] > 0
    assert "effective training time unknown" in log


async def test_the_first_line_matching_the_pattern_is_the_resumption(tmp_path: Path) -> None:
    record, wlog, _ = await run_job(tmp_path, r"--progress-pattern=^step \d+ loss")
    assert record["recovered"] is True
    (crash,) = [w["t"] for w in wlog if w["event"] == "crash"]
    resumed = max(w["t"] for w in wlog if w["event"] == "step" and w["attempt"] == 1)
    errors = {"failed": record["failed_at"] - crash, "resumed": record["resumed_at"] - resumed}
    print("accounting error (s):", errors, "resume phase", record["phases"]["resume"])
    assert all(-0.05 <= e < TOLERANCE for e in errors.values()), errors
    # 'rank R starting', printed before import torch, was not taken for progress
    assert record["phases"]["resume"] > 0.5
