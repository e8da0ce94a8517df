"""Readiness that tells the truth, seen by a real HAProxy in front of a real job.

HAProxy checks ``GET /readyz`` every 100 ms (``fall 1 rise 1``) and logs each change of
the server's state. The job: two ranks that take 1.5 s to start (their "import torch")
before posting a deadline every 50 ms; rank 1 crashes once. The backend must go DOWN
right after the crash and come UP again only once every restarted rank has posted.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import anyio
import pytest

from tests.support.daemon import Stream, pump, supervisor
from tests.support.goodput import WORKER, first_posts, read_jsonl
from tests.support.paths import TESTS
from tests.support.ports import free_port

pytestmark = pytest.mark.skipif(
    shutil.which("haproxy") is None, reason="needs haproxy (apt-get install haproxy)"
)

STATE = re.compile(r"Server job/node0 is (UP|DOWN)")

CONFIG = """
global
    log stdout format raw local0 info
defaults
    mode http
    log global
    timeout connect 1s
    timeout client 5s
    timeout server 5s
    timeout check 1s
listen job
    bind 127.0.0.1:{front}
    option httpchk GET /readyz
    server node0 127.0.0.1:{port} check inter 100ms fall 1 rise 1
"""


def _crash_time(wlog: Path) -> float | None:
    """The crash's wall time as the worker logged it, once it has."""
    if not wlog.exists():
        return None
    for line in wlog.read_text().splitlines():
        if '"exit"' in line and line.endswith("}"):
            return float(json.loads(line)["t"])
    return None


def _recovered(seen: list[tuple[str, float]], crash: float | None) -> bool:
    after = [s for s, t in seen if crash is not None and t > crash]
    return "DOWN" in after and after[-1] == "UP"


async def test_backend_is_down_from_the_crash_until_every_restarted_rank_progressed(
    tmp_path: Path,
) -> None:
    port = free_port()
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(CONFIG.format(front=free_port(), port=port))
    wlog = tmp_path / "workers.jsonl"
    args = ["--health-host", "127.0.0.1", "--health-port", str(port), "--nproc-per-node",
            "2", "--max-restarts", "1", "--log-dir", str(tmp_path / "logs"), WORKER,
            "--log", str(wlog), "--startup", "1.5", "--steps", "60", "--fail-rank", "1",
            "--posts", "30"]
    seen: list[tuple[str, float]] = []  # (state, wall time the test read the log line)
    lines = Stream()
    async with supervisor(args, env={"PYTHONPATH": str(TESTS.parent)}) as sup:
        await sup.err.expect(r"health endpoint on")
        proxy = await anyio.open_process(["haproxy", "-db", "-f", str(cfg)])
        try:
            async with anyio.create_task_group() as tg:
                assert proxy.stdout is not None
                tg.start_soon(pump, proxy.stdout, lines)
                with anyio.fail_after(60):  # until DOWN after the crash, then UP
                    while not _recovered(seen, _crash_time(wlog)):
                        m = STATE.search((await lines.expect(STATE.pattern, 60)).string)
                        assert m is not None
                        seen.append((m.group(1), time.time()))
                tg.cancel_scope.cancel()
        finally:
            proxy.terminate()
            await proxy.wait()
        assert await sup.wait(timeout=60) == 0, sup.err.text()
    log = read_jsonl(wlog)
    (crash,) = [w["t"] for w in log if w["event"] == "exit"]
    resumed = max(first_posts(log, 1).values())
    print("haproxy saw:", [(s, round(t - crash, 3)) for s, t in seen], "resumed",
          round(resumed - crash, 3))
    after = [(s, t) for s, t in seen if t > crash]
    assert after[0][0] == "DOWN", seen
    down_at = after[0][1]
    assert down_at - crash < 2.0  # right after the crash (generous bound for a busy host)
    assert down_at < resumed  # down during the whole restart and re-initialisation
    up_at = next(t for s, t in after if s == "UP")
    assert up_at >= resumed  # up only once every restarted rank has progressed
    assert [s for s, _ in after] == ["DOWN", "UP"]
