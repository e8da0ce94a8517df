"""A rank whose process cannot be started (its spawn raises) fails the attempt as a
worker exiting with 127 would: the same root cause, exit code and restarts (the edges:
tests/unit/test_launch_reports.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import anyio

from supervisor.app import supervise
from supervisor.config import Settings
from tests.support.paths import FAKE_WORKER as FAKE

# one argument over the kernel's MAX_ARG_STRLEN (128 KiB): execve fails with E2BIG, and
# subprocess raises it in the supervisor, before any process of the rank exists
TOO_LONG = "x" * 200_000


def _command(local_rank: int, global_rank: int, rank_dir: Path) -> list[str]:
    if local_rank == 1:
        return [sys.executable, "-c", "pass", TOO_LONG]
    return [sys.executable, FAKE, "--hang"]


def _settings(tmp_path: Path, max_restarts: int) -> Settings:
    return Settings(training_script=FAKE, nproc_per_node="2", max_restarts=max_restarts,
                    log_dir=str(tmp_path / "logs"), event_log=str(tmp_path / "events.jsonl"),
                    no_health=True, shutdown_timeout=5.0, no_warm_restart=True,
                    restart_backoff="0:0")


async def _run(tmp_path: Path, max_restarts: int) -> tuple[int, str, list[str]]:
    env = {**os.environ, "PYTHON_EXEC": sys.executable}
    with anyio.fail_after(60):
        result = await supervise(_settings(tmp_path, max_restarts), env, command=_command,
                                 embedded=True)
    kinds = [json.loads(line)["event"]
             for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    return result.exit_code, result.root_cause, kinds


async def test_a_rank_that_cannot_start_is_the_root_cause_exit_127(tmp_path: Path) -> None:
    code, cause, kinds = await _run(tmp_path, max_restarts=0)
    assert code == 1  # 127 is outside 1..125: the job exits 1, as for any such code
    assert cause.startswith("local rank 1 exited with code 127: ")
    assert "Argument list too long" in cause
    assert "(pid" not in cause  # no process: no pid is shown
    assert "restart_refused" in kinds and "invalid_transition" not in kinds


async def test_a_rank_that_cannot_start_uses_the_restart_budget(tmp_path: Path) -> None:
    code, cause, kinds = await _run(tmp_path, max_restarts=1)
    assert code == 1 and "local rank 1 exited with code 127" in cause
    assert kinds.count("restart_scheduled") == 1 and kinds.count("group_started") == 2
    assert "invalid_transition" not in kinds and "stale_event_dropped" not in kinds
