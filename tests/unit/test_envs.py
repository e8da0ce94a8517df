"""The per-rank environment and command line (pure)."""

from __future__ import annotations

import pytest

from supervisor.core.envs import (
    EnvContractError,
    GroupLayout,
    default_omp_threads,
    standby_python,
    worker_argv,
    worker_env,
)

LAYOUT = GroupLayout("job", "trainer", 2, 1, 3, 2, 6, "10.0.0.1", 29501, 1, 3)


def test_multi_node_ranks() -> None:
    env = worker_env({"PATH": "/bin"}, LAYOUT, 1, error_file="/e", timer_file="/t")
    assert env["RANK"] == "3" and env["LOCAL_RANK"] == "1" and env["GROUP_RANK"] == "1"
    assert env["WORLD_SIZE"] == "6" and env["GROUP_WORLD_SIZE"] == "3"
    assert env["TORCHELASTIC_TIMER_FILE"] == "/t" and env["PATH"] == "/bin"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"


def test_no_timer_file_removes_inherited_one() -> None:
    env = worker_env({"TORCHELASTIC_TIMER_FILE": "/old"}, LAYOUT, 0, error_file="/e",
                     timer_file=None)
    assert "TORCHELASTIC_TIMER_FILE" not in env


def test_virtual_local_rank_narrows_devices() -> None:
    from msgspec.structs import replace

    layout = replace(LAYOUT, virtual_local_rank=True)
    env = worker_env({"CUDA_VISIBLE_DEVICES": "4,5"}, layout, 1, error_file="/e", timer_file=None)
    assert env["LOCAL_RANK"] == "0" and env["CUDA_VISIBLE_DEVICES"] == "5"
    env = worker_env({}, layout, 1, error_file="/e", timer_file=None)
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    with pytest.raises(EnvContractError, match="local rank 1 has no device"):
        worker_env({"CUDA_VISIBLE_DEVICES": "4"}, layout, 1, error_file="/e", timer_file=None)


def test_omp_threads_default_like_torchrun() -> None:
    assert default_omp_threads({}, 4)["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in default_omp_threads({}, 1)
    assert default_omp_threads({"OMP_NUM_THREADS": "8"}, 4)["OMP_NUM_THREADS"] == "8"


def test_argv_forms() -> None:
    assert worker_argv("/py", "t.py", ["--r=${local_rank}"], 2) == ["/py", "-u", "t.py", "--r=2"]
    assert worker_argv("/py", "pkg.mod", [], 0, module=True) == ["/py", "-u", "-m", "pkg.mod"]
    assert worker_argv("/py", "bash", ["-c", "x"], 0, no_python=True) == ["bash", "-c", "x"]


@pytest.mark.parametrize(("no_python", "script", "args", "expected"), [
    (False, "train.py", ["--lr", "1"], "/usr/bin/python3"),  # $PYTHON_EXEC or ours
    (True, "/opt/job/venv/bin/python", ["-u", "train.py"], "/opt/job/venv/bin/python"),
    (True, "/usr/bin/python3.12", ["-u", "-m", "pkg"], "/usr/bin/python3.12"),
    (True, "/opt/job/venv/bin/python", ["train.py"], None),  # buffered: not the form
    (True, "/bin/sh", ["-u", "x"], None),
    (True, "/opt/job/run-python", ["-u", "x"], None),
])
def test_the_standby_python_is_the_job_interpreter_in_the_production_form(
        no_python: bool, script: str, args: list[str], expected: str | None) -> None:
    assert standby_python("/usr/bin/python3", no_python=no_python, script=script,
                          args=args) == expected
