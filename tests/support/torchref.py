"""The reference a torch training test compares with: examples/ddp_train.py's final loss
under torchrun, run uninterrupted.

The job is seeded and its checkpoints restore the optimiser state, so any run of it that
completes (on one node or several, resumed from a checkpoint or not, warm or cold) ends
with the same loss as this one. Each reference is run once per process and kept: the torch
tests share one xdist worker (group ``torch``), so a reference costs its ranks' start-up
(seconds of CPU each) once per suite, not once per test.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO

TRAIN = str(REPO / "examples" / "ddp_train.py")
STEPS = ["--steps", "120", "--checkpoint-every", "20", "--batch", "32"]
FINAL = r"final loss (\d+\.\d+) after 120 steps$"

_KEPT: list[str] = []  # the final loss, once run in this process


def torchrun_final_loss(tmp_path: Path) -> str:
    """The job's final loss (``STEPS``) under ``torchrun --nproc-per-node 2``; run in
    ``tmp_path`` the first time it is asked for in this process."""
    if not _KEPT:
        _KEPT.append(_run(tmp_path))
    return _KEPT[0]


def _run(tmp_path: Path) -> str:
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
