"""A rank whose process cannot be started (its spawn raises) fails the attempt as a
worker exiting with 127 would: the same root cause, exit code and restarts. Its report
goes through the inbox like every event, behind whatever was queued first (a shutdown
request then meets the launch while stopping)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import anyio

from supervisor.app import supervise
from supervisor.config import Settings
from supervisor.core import state as sm
from supervisor.core.policy import RestartPolicy

FAKE = str(Path(__file__).parent / "workers" / "fake_worker.py")
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


# ---------------------------------------------------------------- pure: the edges

POLICY = RestartPolicy(max_restarts=0)


def _starting() -> sm.State:
    state, decision = sm.transition(sm.State(), sm.RendezvousComplete(1, 2), POLICY)
    assert state.phase is sm.Phase.STARTING and decision == sm.LaunchGroup(1, 0)
    return state


def test_a_shutdown_queued_before_the_launch_stops_the_new_group() -> None:
    state, decision = sm.transition(_starting(), sm.ShutdownRequested(15), POLICY)
    assert decision == sm.StopGroup(sm.StopReason.SHUTDOWN, 15)
    state, decision = sm.transition(state, sm.GroupLaunched(1, frozenset({0, 1}), 1.0), POLICY)
    assert (state.phase, state.attempt, state.running, decision) == (
        sm.Phase.STOPPING, 1, frozenset({0, 1}), sm.Nothing())
    exited = sm.WorkerExited(1, 0, 10, None, 15, 2.0)
    assert not sm.is_stale(state, exited)  # the new group's exits are current
    state, _ = sm.transition(state, exited, POLICY)
    state, decision = sm.transition(state, sm.GroupStopped(3.0), POLICY)
    assert (state.phase, decision) == (sm.Phase.STOPPED, sm.Exit(128 + 15, "stopped by SIGTERM"))


def test_a_shutdown_queued_before_a_failed_preparation_ends_the_run() -> None:
    state, _ = sm.transition(_starting(), sm.ShutdownRequested(15), POLICY)
    state, decision = sm.transition(state, sm.LaunchFailed(1, "disk full", 1.0), POLICY)
    assert (state.phase, decision, state.root_cause) == (sm.Phase.STOPPING, sm.Nothing(), None)
    state, _ = sm.transition(state, sm.GroupStopped(2.0), POLICY)
    assert state.phase is sm.Phase.STOPPED


def test_a_rank_that_cannot_start_fails_like_an_exit_127() -> None:
    running, _ = sm.transition(_starting(), sm.GroupLaunched(1, frozenset({0, 1}), 1.0), POLICY)
    state, decision = sm.transition(running, sm.WorkerFailedToStart(1, 1, "E2BIG", 2.0), POLICY)
    assert decision == sm.StopGroup(sm.StopReason.FAILURE)
    assert state.running == frozenset({0})
    root = state.root_cause
    assert root is not None
    assert (root.kind, root.local_rank, root.exit_code, root.pid) == (
        sm.FailureKind.EXITED, 1, 127, None)
    assert root.describe() == "local rank 1 exited with code 127: E2BIG"
    assert root.process_exit_code == 1
