"""``--nproc-per-node auto`` and ``cpu`` count the CPUs the supervisor may run on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import deps

COUNT = ("from supervisor.config import build; "
         "print(build({'training_script': 'x', 'nproc_per_node': %r}).local_world_size)")


def pinned(*argv: str) -> subprocess.CompletedProcess[str]:
    taskset = deps.need_binary("taskset", "apt-get install util-linux")
    return subprocess.run([taskset, "-c", "0", *argv], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to tell apart")
@pytest.mark.parametrize("word", ["auto", "cpu"])
def test_one_cpu_allowed_means_one_worker(word: str) -> None:
    result = pinned(sys.executable, "-c", COUNT % word)
    assert result.stdout.strip() == "1", result.stderr


@pytest.mark.torch
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to tell apart")
def test_the_count_is_torchs() -> None:
    deps.need_module("torch")
    theirs = pinned(sys.executable, "-c", "import torch; print(torch._utils.cpu_count())")
    ours = pinned(sys.executable, "-c", COUNT % "auto")
    assert ours.stdout == theirs.stdout == "1\n"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to tell apart")
def test_a_pinned_run_starts_one_worker(tmp_path: Path) -> None:
    script = "import os, sys; open(os.path.join(sys.argv[1], os.environ['RANK']), 'w').close()"
    result = pinned(sys.executable, "-m", "supervisor", "run", "--nproc-per-node=auto",
                    "--health-port=0", f"--log-dir={tmp_path / 'logs'}", "--no-python",
                    sys.executable, "-c", script, str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "logs") == ["0"]
