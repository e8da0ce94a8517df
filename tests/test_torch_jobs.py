"""Real PyTorch DDP jobs (gloo, CPU) under elastic-supervisor and under torchrun."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, supervisor

if os.environ.get("CI"):
    import torch  # noqa: F401  (.ci/run installs torch: a missing one must fail, not skip)
else:
    pytest.importorskip("torch", reason="pip install torch==2.13.0 to run the DDP jobs")
pytestmark = pytest.mark.torch

TRAIN = str(REPO / "examples" / "ddp_train.py")
STEPS = ["--steps", "120", "--checkpoint-every", "20", "--batch", "32"]
FINAL = r"^final loss (\d+\.\d+) after 120 steps$"


def torchrun_final_loss(tmp_path: Path) -> str:
    torchrun = Path(sys.executable).parent / "torchrun"
    result = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", "--log-dir", str(tmp_path / "tr-logs"),
         TRAIN, *STEPS, "--checkpoint-dir", str(tmp_path / "tr-ck")],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    m = re.search(FINAL, result.stdout, re.M)
    assert m, result.stdout[-2000:]
    return m.group(1)


async def test_same_final_loss_as_torchrun(tmp_path: Path) -> None:
    expected = torchrun_final_loss(tmp_path)
    args = ["--health-port", "0", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
            TRAIN, *STEPS, "--checkpoint-dir", str(tmp_path / "ck")]
    async with supervisor(args) as sup:
        loss = (await sup.out.expect(FINAL, timeout=240)).group(1)
        assert await sup.wait() == 0
    assert loss == expected


async def test_killed_rank_restarts_and_resumes_from_checkpoint(tmp_path: Path) -> None:
    args = ["--health-port", "0", "--nproc-per-node", "2", "--max-restarts", "1",
            "--log-dir", str(tmp_path / "logs"), TRAIN, *STEPS,
            "--checkpoint-dir", str(tmp_path / "ck")]
    async with supervisor(args) as sup:
        pid = int((await sup.out.expect(r"^rank 1/2 pid (\d+) starting at step 0",
                                        timeout=120)).group(1))
        await sup.out.expect(r"^checkpoint at step 40$", timeout=120)
        os.kill(pid, signal.SIGKILL)
        resumed = await sup.out.expect(r"^rank \d/2 pid \d+ starting at step (\d+) \(restart 1\)",
                                       timeout=120)
        assert int(resumed.group(1)) >= 40
        loss = (await sup.out.expect(FINAL, timeout=240)).group(1)
        assert await sup.wait() == 0
        await sup.err.expect(r"killed by SIGKILL")
    # resuming from the checkpoint reproduces the unbroken run exactly
    assert loss == torchrun_final_loss(tmp_path)


async def test_exception_traceback_is_root_cause(tmp_path: Path) -> None:
    args = ["--health-port", "0", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
            TRAIN, *STEPS, "--checkpoint-dir", str(tmp_path / "ck"), "--raise-at", "5"]
    async with supervisor(args) as sup:
        assert await sup.wait(timeout=240) == 1
        await sup.err.expect(r"root cause: local rank 1 .* exited with code 1: "
                             r"RuntimeError: injected failure at step 5")
    error_file = tmp_path / "logs" / "none" / "attempt_0" / "1" / "error.json"
    assert "Traceback" in error_file.read_text()
