"""``supervise()`` returns a typed result: the exit code and the root cause, with the
workers that failed before the group began to stop (what the Python API reports)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio

from supervisor.app import supervise
from supervisor.config import Settings
from tests.support.paths import FAKE_WORKER


def _settings(tmp_path: Path, *args: str) -> Settings:
    return Settings(training_script=FAKE_WORKER, training_script_args=list(args),
                    nproc_per_node="2", log_dir=str(tmp_path / "logs"), no_health=True,
                    shutdown_timeout=5.0, no_warm_restart=True)


async def test_a_failed_group_returns_its_root_cause_and_exit_code(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON_EXEC": sys.executable}
    with anyio.fail_after(60):
        result = await supervise(_settings(tmp_path, "--exit", "3", "--fail-rank", "1"),
                                 env, embedded=True)
    assert result.exit_code == 3
    assert "local rank 1" in result.root_cause and "exited with code 3" in result.root_cause
    assert [(f.local_rank, f.global_rank, f.exit_code) for f in result.failures] == [(1, 1, 3)]
    assert result.attempt_started


async def test_a_successful_run_returns_exit_code_0_and_no_cause(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON_EXEC": sys.executable}
    with anyio.fail_after(60):
        result = await supervise(_settings(tmp_path, "--exit", "0"), env, embedded=True)
    assert (result.exit_code, result.root_cause, result.failures) == (0, "", ())
