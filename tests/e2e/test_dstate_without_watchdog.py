"""The D-state check is a health signal of its own: it runs with the deadline FIFO off
(``--no-watchdog``, ``TORCHELASTIC_ENABLE_FILE_TIMER=0``), where it used to stop too."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.daemon import supervisor
from tests.support.paths import FAKE_WORKER
from tests.support.watchdog import Freezer


@pytest.mark.parametrize("off", [["--no-watchdog"], ["TORCHELASTIC_ENABLE_FILE_TIMER=0"]],
                         ids=["no-watchdog", "file-timer-disabled"])
async def test_a_worker_in_d_state_fails_the_node_without_the_fifo(
        tmp_path: Path, freezer: Freezer, off: list[str]) -> None:
    flags = [a for a in off if a.startswith("--")]
    env = dict(a.split("=", 1) for a in off if "=" in a)
    args = ["--nproc-per-node", "1", "--no-health", "--hang-state-timeout", "0.5",
            "--shutdown-timeout", "2", "--log-dir", str(tmp_path / "logs"), *flags,
            FAKE_WORKER, "--hang"]
    async with supervisor(args, env=env) as sup:
        pid = int((await sup.out.expect(r"^ready 0 (\d+)")).group(1))
        assert "deadline FIFO at" not in sup.err.text()  # the FIFO is really off
        freezer.freeze(pid)
        await sup.err.expect(r"uninterruptible sleep \(D\)", timeout=30)
        freezer.release()  # a frozen process cannot die: let the stop finish
        assert await sup.wait() != 0
