"""A worker that plants FIFOs where the supervisor opens files cannot hang it.

Regression (issue 52, finding 2): a worker ran ``rm events.jsonl; mkfifo events.jsonl``,
then SIGHUP (logrotate's daily action) made the supervisor reopen the event log on the
event loop, blocking in ``open`` until someone read the FIFO: ``/healthz`` stopped
answering and SIGTERM was ignored; the next start with the same run id hung in its check
of the event log. Now every such open is non-blocking, refused unless a regular file, and
the SIGHUP reopen runs off the loop: the old files go on being written.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from tests.support.daemon import supervisor
from tests.support.paths import FAKE_WORKER, REPO, WORKERS

GRACE = 5
BASE = ["--health-port", "0", "--shutdown-timeout", str(GRACE), "--rdzv-id", "jobX"]
PLANTER = str(WORKERS / "fifo_planter.py")
HUNG = str(WORKERS / "hung_over_a_fifo.py")
PY_SPY = Path(sys.executable).parent / "py-spy"


def _run(log_dir: Path) -> subprocess.CompletedProcess[str]:
    """A fresh start with the same run id; a hang fails the test at the timeout."""
    return subprocess.run(
        [sys.executable, "-m", "supervisor", "run", *BASE, "--log-dir", str(log_dir),
         FAKE_WORKER, "--exit", "0"], capture_output=True, text=True, timeout=60, check=False)


async def test_sighup_after_a_worker_planted_fifos_neither_hangs_nor_loses_the_logs(
    tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    args = [*BASE, "--tee", "3", "--log-dir", str(logs), PLANTER]
    async with supervisor(args) as sup:
        port = await sup.serving()
        await sup.out.expect(r"^\[default0\]:planted$")
        sup.signal(signal.SIGHUP)
        await sup.err.expect(r"cannot reopen event log .*events.jsonl: .*FIFO.*; still "
                             r"writing the old file")
        await sup.err.expect(r"cannot reopen .*stdout.log: .*FIFO")
        await sup.err.expect(r"cannot reopen .*stderr.log: .*FIFO")
        await sup.err.expect(r"log files reopened")
        timeout = aiohttp.ClientTimeout(total=5)
        async with (aiohttp.ClientSession(timeout=timeout) as session,
                    session.get(f"http://127.0.0.1:{port}/healthz") as response):
            assert response.status == 200
        started = time.monotonic()
        sup.signal(signal.SIGTERM)
        assert await sup.wait(timeout=GRACE + 15) == 128 + signal.SIGTERM
        assert time.monotonic() - started < GRACE + 10
    assert "Traceback" not in sup.err.text()
    run_dir = logs / "jobX"
    assert (run_dir / "preload-auto.json").is_fifo()  # nothing was written through it


def test_a_fresh_start_over_a_planted_fifo_event_log_fails_with_one_line(
    tmp_path: Path
) -> None:
    run_dir = tmp_path / "jobX"
    run_dir.mkdir(mode=0o755)
    os.mkfifo(run_dir / "events.jsonl")
    result = _run(tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "cannot open the event log" in lines[0] and "is a FIFO" in lines[0]


def test_a_run_directory_writable_by_its_group_is_refused(tmp_path: Path) -> None:
    (tmp_path / "jobX").mkdir()
    (tmp_path / "jobX").chmod(0o770)
    result = _run(tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "log_dir: unsafe run directory" in lines[0]
    assert "is writable by its group (mode 770)" in lines[0]



@pytest.mark.skipif(not PY_SPY.is_file(), reason="py-spy is not installed next to the "
                    "interpreter (pip install 'elastic-supervisor[hang-dump]')")
async def test_a_fifo_at_the_hang_dump_path_is_not_opened(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    args = ["--nproc-per-node", "1", "--max-restarts", "0", "--hang-dump", "py-spy",
            "--no-health", "--log-dir", str(logs), HUNG]
    async with supervisor(args, env={"PYTHONPATH": str(REPO)}) as sup:
        pid = int((await sup.out.expect(r"^ready (\d+)$")).group(1))
        await sup.err.expect(rf"py-spy dump of pid {pid} failed: .*File exists", timeout=30)
        assert await sup.wait(30) != 0  # the hung rank was killed: the job failed
    assert (logs / "none" / "attempt_0" / "0" / f"hang-{pid}.txt").is_fifo()
