"""A frozen supervisor (SIGSTOP, then SIGCONT) does not kill healthy workers as hung.

Regression test for issue 18 item 9: while the supervisor was stopped, its workers went on
renewing 3 s deadlines every second; the renewals sat unread in the FIFO, and on SIGCONT the
deadline timer judged before the FIFO was read ("deadline 'step' expired 2.139 s ago").
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import anyio
import pytest

from tests.conftest import pid_alive, supervisor

RENEW = """
import os, sys, time
from supervisor.worker import expires
rank = int(os.environ["RANK"])
os.write(1, f"ready {rank} {os.getpid()} {os.environ['TORCHELASTIC_RESTART_COUNT']}\\n".encode())
step = 0
while True:
    with expires(after=3.0, scope="step"):
        time.sleep(1.0)
    step += 1
    os.write(1, f"step {rank} {step} {time.time():.3f}\\n".encode())
"""

FREEZE = 5.0  # seconds the supervisor is stopped: longer than the 3 s deadlines


def events(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def freeze_and_check(tmp_path: Path) -> None:
    worker = tmp_path / "renew.py"
    worker.write_text(RENEW)
    log_dir = tmp_path / "logs"
    args = ["--health-port", "0", "--nproc-per-node", "2", "--max-restarts", "0",
            "--log-dir", str(log_dir), "--rdzv-id", "freeze", str(worker)]
    async with supervisor(args) as sup:
        ready = [await sup.out.expect(r"^ready (\d) (\d+) 0$") for _ in range(2)]
        pids = sorted(int(m.group(2)) for m in ready)
        for _ in range(2):
            await sup.out.expect(r"^step \d \d+ ")
        os.kill(sup.pid, signal.SIGSTOP)
        try:
            await anyio.sleep(FREEZE)  # the fault itself lasts this long; nothing to wait on
        finally:
            os.kill(sup.pid, signal.SIGCONT)
        thawed = time.time()
        # every worker renews three more times after the thaw: an expiry judged on stale
        # deadlines would have fired at once, long before the last of these steps
        seen = {"0": 0, "1": 0}
        with anyio.fail_after(30):
            while min(seen.values()) < 3:
                m = await sup.out.expect(r"^step (\d) \d+ (\S+)$")
                if float(m.group(2)) > thawed:
                    seen[m.group(1)] += 1
        assert "expired" not in sup.err.text(), sup.err.text()
        assert all(pid_alive(pid) for pid in pids)
        sup.signal(signal.SIGTERM)
        assert await sup.wait() == 143
    kinds = [e["event"] for e in events(log_dir / "freeze" / "events.jsonl")]
    assert "deadline_expired" not in kinds
    assert "group_stopping" not in kinds or kinds.count("group_started") == 1


async def test_frozen_supervisor_keeps_healthy_workers(tmp_path: Path) -> None:
    await freeze_and_check(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("run", range(16))
async def test_frozen_supervisor_keeps_healthy_workers_16_runs(tmp_path: Path, run: int) -> None:
    await freeze_and_check(tmp_path)
