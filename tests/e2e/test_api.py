"""The Python API (``supervisor.launch`` / ``alaunch``) with real worker processes.

The functions the ranks run are in ``tests/workers/api_ranks.py``; a fresh interpreter
per rank imports it to find them, as ``multiprocessing``'s spawn would.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

import supervisor
from supervisor.api import WorkerGroupFailed, launch_settings
from supervisor.config import ConfigError, build
from supervisor.workers.bootstrap import error_record, substitute
from tests.support import deps
from tests.support.processes import pid_alive, wait_dead
from tests.workers.api_ranks import (
    fail_first_attempt,
    fail_on_rank_one,
    hang_with_pid,
    rank_report,
    return_unpicklable,
)

# ----------------------------------------------------------------------------- helpers


def config(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {"log_dir": str(tmp_path / "logs"), "health_port": 0, "shutdown_timeout": 5,
            **extra}


# ----------------------------------------------------------------------------- callables


def test_callable_returns_each_ranks_value(tmp_path: Path) -> None:
    result = supervisor.launch(config(tmp_path, nproc_per_node=3), rank_report, 10,
                               "lr${local_rank}")
    assert result == {
        rank: {"rank": rank, "scaled": 10 * rank, "tag": f"lr{rank}", "world": 3}
        for rank in range(3)
    }


def test_callable_exception_is_the_root_cause(tmp_path: Path) -> None:
    with pytest.raises(WorkerGroupFailed) as caught:
        supervisor.launch(config(tmp_path, nproc_per_node=2), fail_on_rank_one, "bad input")
    exc = caught.value
    assert exc.exit_code == 1
    assert list(exc.failures) == [1]
    first = exc.get_first_failure()
    assert first is not None and first[0] == 1
    assert exc.message == "ValueError: bad input"
    assert "in fail_on_rank_one" in exc.traceback
    assert 'raise ValueError(message)' in exc.traceback
    assert "bootstrap.py" not in exc.traceback  # the user's frames only
    assert "ValueError: bad input" in str(exc) and "root cause" in str(exc)
    assert "tests.workers.api_ranks.fail_on_rank_one FAILED" in str(exc)


def test_error_file_has_torchs_format(tmp_path: Path) -> None:
    with pytest.raises(WorkerGroupFailed) as caught:
        supervisor.launch(config(tmp_path, nproc_per_node=2), fail_on_rank_one, "boom")
    data = json.loads(Path(caught.value.failures[1].error_file).read_text())
    assert data["message"]["message"] == "ValueError: boom"
    extra = data["message"]["extraInfo"]
    assert extra["py_callstack"].startswith("Traceback (most recent call last)")
    assert extra["timestamp"].isdigit()


@pytest.mark.torch
def test_torch_reads_our_error_file(tmp_path: Path) -> None:
    errors = deps.need_module("torch.distributed.elastic.multiprocessing.errors")
    with pytest.raises(WorkerGroupFailed) as caught:
        supervisor.launch(config(tmp_path, nproc_per_node=2), fail_on_rank_one, "boom")
    failure = caught.value.failures[1]
    torch_failure = errors.ProcessFailure(
        local_rank=1, pid=failure.pid or 0, exitcode=1, error_file=failure.error_file
    )
    assert torch_failure.message["message"] == "ValueError: boom"


def test_callable_group_restarts_and_returns_the_last_attempts_values(tmp_path: Path) -> None:
    result = supervisor.launch(config(tmp_path, nproc_per_node=2, max_restarts=1),
                               fail_first_attempt)
    assert result == {0: (0, 1), 1: (1, 1)}


def test_restart_budget_exhausted_raises(tmp_path: Path) -> None:
    with pytest.raises(WorkerGroupFailed) as caught:
        supervisor.launch(config(tmp_path, nproc_per_node=1), fail_first_attempt)
    assert caught.value.message == "RuntimeError: first attempt fails"


def test_unpicklable_return_value_fails_the_rank(tmp_path: Path) -> None:
    with pytest.raises(WorkerGroupFailed) as caught:
        supervisor.launch(config(tmp_path), return_unpicklable)
    assert "pickle" in caught.value.message.lower()


def test_settings_object_is_accepted(tmp_path: Path) -> None:
    settings = build({"training_script": "ignored", "nproc_per_node": "2",
                      "log_dir": str(tmp_path), "health_port": 0})
    assert supervisor.launch(settings, rank_report, 1, "x")[1]["rank"] == 1


# ----------------------------------------------------------------------------- commands


def test_command_entrypoint_returns_none_per_rank(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    code = "import sys; open(sys.argv[1] + '/' + sys.argv[2], 'w').close()"
    result = supervisor.launch(config(tmp_path, nproc_per_node=2), sys.executable, "-c", code,
                               out, "rank${local_rank}")
    assert result == {0: None, 1: None}
    assert sorted(p.name for p in out.iterdir()) == ["rank0", "rank1"]


def test_failing_command_raises_with_its_exit_code(tmp_path: Path) -> None:
    with pytest.raises(WorkerGroupFailed) as caught:
        supervisor.launch(config(tmp_path, nproc_per_node=2), sys.executable, "-c",
                          "import os, sys; sys.exit(3 if os.environ['RANK'] == '1' else 0)")
    assert caught.value.exit_code == 3
    assert caught.value.failures[1].exit_code == 3


def test_missing_command_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="command not found"):
        supervisor.launch(config(tmp_path), "no-such-command-here")


# ----------------------------------------------------------------------------- async


async def test_alaunch_from_async_code(tmp_path: Path) -> None:
    result = await supervisor.alaunch(config(tmp_path, nproc_per_node=2), rank_report, 2, "a")
    assert result[1] == {"rank": 1, "scaled": 2, "tag": "a", "world": 2}


async def test_cancelled_alaunch_leaves_no_worker_running(tmp_path: Path) -> None:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    with anyio.move_on_after(30) as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(supervisor.alaunch, config(tmp_path, nproc_per_node=2),
                          hang_with_pid, str(pid_dir))
            with anyio.fail_after(15):
                while len(list(pid_dir.iterdir())) < 2:
                    await anyio.sleep(0.05)  # the workers tell us nothing else
            tg.cancel_scope.cancel()
    assert not scope.cancelled_caught
    pids = [int(p.read_text()) for p in pid_dir.iterdir()]
    await wait_dead(pids, timeout=10)
    assert not any(pid_alive(pid) for pid in pids)


# ----------------------------------------------------------------------------- settings


def test_fork_is_refused_for_callables(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'fork' is not supported"):
        launch_settings(config(tmp_path, start_method="fork"), rank_report, ())


def test_forkserver_runs_like_spawn(tmp_path: Path) -> None:
    settings = launch_settings(config(tmp_path, start_method="forkserver"), rank_report, ())
    assert settings.start_method == "forkserver"
    result = supervisor.launch(config(tmp_path, start_method="forkserver"), rank_report, 1, "f")
    assert result == {0: {"rank": 0, "scaled": 0, "tag": "f", "world": 1}}


def test_command_settings_run_the_executable_itself(tmp_path: Path) -> None:
    settings = launch_settings(config(tmp_path, module=True), "/bin/echo", ("a", 1))
    assert (settings.no_python, settings.module) == (True, False)
    assert settings.training_script_args == ["a", "1"]


def test_unpicklable_entrypoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="picklable"):
        supervisor.launch(config(tmp_path), lambda: 1)


def test_unknown_setting_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown setting"):
        launch_settings({"nproc": 2}, rank_report, ())


# ----------------------------------------------------------------------------- bootstrap


def test_substitute_replaces_local_rank_in_strings_only() -> None:
    assert substitute(["--out=${local_rank}", 5, "$other"], 3) == ["--out=3", 5, "$other"]


def test_error_record_matches_torchs_record() -> None:
    try:
        raise KeyError("k")
    except KeyError as exc:
        record = error_record(exc)
    assert record["message"]["message"] == "KeyError: 'k'"
    assert "raise KeyError" in record["message"]["extraInfo"]["py_callstack"]
