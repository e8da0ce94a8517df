"""The Python API as code written for torch's ``elastic_launch`` uses it: the failure is
a ``ChildFailedError`` once torch's errors module is imported, ``LaunchConfig`` is a
config, and a launch without a run id gets a unique one (supervisor.torchcompat).

Rank functions live at the top: each rank is a fresh interpreter importing this module.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import supervisor
from supervisor.api import WorkerGroupFailed, launch_settings
from tests.support import deps
from tests.support.etcd import etcd_factory
from tests.support.paths import WORKERS
from tests.support.ports import free_port


def scaled_rank() -> int:
    return 10 + int(os.environ["RANK"])


def fail_on_rank_one(message: str) -> str:
    if os.environ["RANK"] == "1":
        raise ValueError(message)
    return "fine"


def config(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {"log_dir": str(tmp_path / "logs"), "health_port": 0, "shutdown_timeout": 5,
            "rdzv_id": "compat", **extra}


def torch_errors() -> Any:
    return deps.need_module("torch.distributed.elastic.multiprocessing.errors")


# ----------------------------------------------------------------------------- failures


def test_without_torch_imported_the_failure_is_ours_alone(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(WORKERS / "api_failure_probe.py"),
                             str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert "caught WorkerGroupFailed Exception BaseException object" in result.stdout, \
        result.stderr
    assert "torch imported: False" in result.stdout


@pytest.mark.torch
def test_except_child_failed_error_catches_a_failed_command(tmp_path: Path) -> None:
    errors = torch_errors()
    with pytest.raises(errors.ChildFailedError) as caught:
        supervisor.launch(config(tmp_path, nproc_per_node=2), sys.executable, "-c",
                          "import os, sys; sys.exit(3 if os.environ['RANK'] == '1' else 0)")
    exc = caught.value
    assert isinstance(exc, WorkerGroupFailed) and exc.exit_code == 3
    rank, failure = exc.get_first_failure()
    assert rank == 1 and isinstance(failure, errors.ProcessFailure)
    assert (failure.exitcode, failure.local_rank, failure.error_file) == (3, 1, "<N/A>")
    assert failure.exit_code == 3 and failure.global_rank == 1  # our fields are there too
    assert "Root Cause (first observed failure)" in errors.ChildFailedError.format_msg(exc)


@pytest.mark.torch
def test_the_error_file_is_read_as_torch_reads_it(tmp_path: Path) -> None:
    errors = torch_errors()
    with pytest.raises(errors.ChildFailedError) as caught:
        supervisor.launch(config(tmp_path, nproc_per_node=2), fail_on_rank_one, "boom")
    failure = caught.value.failures[1]
    theirs = errors.ProcessFailure(local_rank=1, pid=failure.pid, exitcode=1,
                                   error_file=failure.error_file)
    assert (failure.message, failure.timestamp) == (theirs.message, theirs.timestamp)
    assert failure.message["message"] == "ValueError: boom"
    assert caught.value.message == "ValueError: boom"  # ours, as without torch


@pytest.mark.torch
def test_a_malformed_error_file_still_gives_the_exception(tmp_path: Path) -> None:
    errors = torch_errors()
    write = ("import os; open(os.environ['TORCHELASTIC_ERROR_FILE'], 'w').write('{\"mess');"
             "raise SystemExit(4)")
    with pytest.raises(errors.ChildFailedError) as caught:
        supervisor.launch(config(tmp_path), sys.executable, "-c", write)
    failure = caught.value.failures[0]
    assert (failure.exitcode, failure.error_file) == (4, "<N/A>")
    with pytest.raises(ValueError):  # what torch's own ProcessFailure does with the file
        errors.ProcessFailure(local_rank=0, pid=1, exitcode=4,
                              error_file=failure.rank_failure.error_file)
    assert "exitcode  : 4" in str(errors.ChildFailedError.format_msg(caught.value))


@pytest.mark.torch
def test_except_worker_group_failed_still_works_with_torch_imported(tmp_path: Path) -> None:
    torch_errors()
    with pytest.raises(WorkerGroupFailed) as caught:
        supervisor.launch(config(tmp_path), sys.executable, "-c", "raise SystemExit(5)")
    assert caught.value.rank_failures[0].exit_code == 5
    assert caught.value.failures[0].exit_code == 5


# ----------------------------------------------------------------------------- LaunchConfig


def launch_config(**fields: Any) -> Any:
    api = deps.need_module("torch.distributed.launcher.api")
    return api.LaunchConfig(**{"monitor_interval": 0.1, "start_method": "spawn",
                               "max_restarts": 0, **fields})


@pytest.mark.torch
def test_a_static_launch_config_runs_a_function(tmp_path: Path) -> None:
    logs = deps.need_module("torch.distributed.elastic.multiprocessing")
    cfg = launch_config(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="static-cfg",
                        rdzv_backend="static", rdzv_endpoint=f"127.0.0.1:{free_port()}",
                        rdzv_configs={"rank": 0},
                        logs_specs=logs.DefaultLogsSpecs(log_dir=str(tmp_path), redirects=3))
    assert supervisor.launch(cfg, scaled_rank) == {0: 10, 1: 11}
    assert len(list(tmp_path.glob("static-cfg/attempt_0/*/stdout.log"))) == 2


@pytest.mark.torch
def test_a_custom_logs_spec_is_refused(tmp_path: Path) -> None:
    logs = deps.need_module("torch.distributed.elastic.multiprocessing")

    class Mine(logs.DefaultLogsSpecs):  # type: ignore[misc, name-defined]
        pass

    cfg = launch_config(min_nodes=1, max_nodes=1, nproc_per_node=1, rdzv_backend="static",
                        rdzv_endpoint="127.0.0.1:0", logs_specs=Mine(log_dir=str(tmp_path)))
    with pytest.raises(supervisor.api.ConfigError, match="custom LogsSpecs"):
        launch_settings(cfg, scaled_rank, ())


@pytest.mark.torch
@pytest.mark.etcd
def test_two_launches_without_run_id_against_one_etcd_both_run(tmp_path: Path) -> None:
    """api_test.py's configs: etcd, run_id "". A fixed default id made the second fail
    with 'job none is closed'."""
    with etcd_factory(tmp_path) as etcd:
        endpoint = etcd.single().endpoint.removeprefix("http://")
        for _ in range(2):
            cfg = launch_config(min_nodes=1, max_nodes=1, nproc_per_node=2,
                                rdzv_endpoint=endpoint, rdzv_backend="etcd")
            assert supervisor.launch(cfg, scaled_rank) == {0: 10, 1: 11}


# ----------------------------------------------------------------------------- run id


def test_no_run_id_gets_a_unique_one_with_torchs_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        first = launch_settings({}, scaled_rank, ()).rdzv_id
        second = launch_settings({"rdzv_id": ""}, scaled_rank, ()).rdzv_id
    assert first != second and first.isdigit()
    assert f"config has no run_id, generated a random run_id: {first}" in caplog.text


def test_a_given_run_id_is_kept() -> None:
    assert launch_settings({"rdzv_id": "none"}, scaled_rank, ()).rdzv_id == "none"
