"""Issue 18 end to end, once the composition root and the launch code use the new hooks.

The mechanisms are tested on their own (test_freeze, test_diskfull, test_hardening); these
tests check that the real daemon wires them: a stall and lost output become events and
metrics, attempt directories are created exclusively. They are ``xfail(strict=True)``
until the wiring lands (app.py and the worker-group code belong to other changes): then
they pass, and strict xfail asks for the marker to go.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import anyio

from tests.support.daemon import supervisor
from tests.support.metrics import metrics_text
from tests.support.paths import FAKE_WORKER, WORKERS
from tests.support.tmpfs import fill, small_tmpfs


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]





async def test_a_frozen_daemon_writes_a_loop_stall_event_and_counts_it(tmp_path: Path) -> None:
    args = ["--health-port", "0", "--health-host", "127.0.0.1", "--log-dir", str(tmp_path),
            "--rdzv-id", "stall", FAKE_WORKER, "--hang"]
    async with supervisor(args) as sup:
        port = int((await sup.err.expect(r"health endpoint on http://[^:]+:(\d+)")).group(1))
        await sup.out.expect(r"^ready 0 ")
        os.kill(sup.pid, signal.SIGSTOP)
        try:
            await anyio.sleep(3.0)  # the fault itself lasts this long
        finally:
            os.kill(sup.pid, signal.SIGCONT)
        await sup.err.expect(r"event loop stalled for")
        text = await metrics_text(port)
        sup.signal(signal.SIGTERM)
        assert await sup.wait() == 143
    [stall] = [r for r in records(tmp_path / "stall" / "events.jsonl")
               if r["event"] == "loop_stall"]
    assert stall["cause"] == "stall" and stall["seconds"] > 1.0
    assert "elastic_supervisor_event_loop_stalls_total 1.0" in text


TICKER = (WORKERS / "ticker.py").read_text()



async def test_lost_output_becomes_events_and_metrics(tmp_path: Path) -> None:
    script = tmp_path / "ticker.py"
    script.write_text(TICKER)
    with small_tmpfs(tmp_path / "disk", size="4m") as disk:
        args = ["--health-port", "0", "--health-host", "127.0.0.1", "--redirects", "3",
                "--log-dir", str(disk), "--rdzv-id", "full", str(script)]
        async with supervisor(args) as sup:
            port = int((await sup.err.expect(r"health endpoint on http://[^:]+:(\d+)")).group(1))
            stdout_log = disk / "full" / "attempt_0" / "0" / "stdout.log"
            with anyio.fail_after(15):
                while not stdout_log.exists() or b"ready" not in stdout_log.read_bytes():
                    await anyio.sleep(0.02)  # the file is the only sign; it has no event
            filler = fill(disk)
            await sup.err.expect(r"cannot write \S+stdout.log: No space left on device")
            filler.unlink()
            resumed = await sup.err.expect(r"writing \S+stdout.log again: (\d+) bytes")
            text = await metrics_text(port)
            sup.signal(signal.SIGTERM)
            assert await sup.wait() == 143
        got = records(disk / "full" / "events.jsonl")
    kinds = [r["event"] for r in got]
    assert "output_write_failed" in kinds
    [lost] = [r for r in got if r["event"] == "output_lost"]
    assert lost["bytes"] == int(resumed.group(1)) and lost["resumed"] is True
    assert "elastic_supervisor_output_lost_bytes_total 0.0" not in text
    assert "elastic_supervisor_output_lost_bytes_total" in text



async def test_a_planted_attempt_directory_is_not_used(tmp_path: Path) -> None:
    """A worker of attempt 0 plants attempt_1/0/error.json; attempt 1 must not use it."""
    run_dir = tmp_path / "plant"
    script = tmp_path / "plant.py"
    script.write_text(
        "import json, os, pathlib, sys\n"
        "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
        "    here = pathlib.Path(os.environ['TORCHELASTIC_ERROR_FILE']).parent.parent\n"
        "    planted = here.parent / 'attempt_1' / '0'\n"
        "    planted.mkdir(parents=True)\n"
        "    (planted / 'error.json').write_text(json.dumps({'message': 'planted-text'}))\n"
        "    sys.exit(3)\n"
        "sys.exit(4)\n"
    )
    args = ["--health-port", "0", "--max-restarts", "1", "--log-dir", str(tmp_path),
            "--rdzv-id", "plant", str(script)]
    async with supervisor(args) as sup:
        assert await sup.wait() == 4
    started = [r["dir"] for r in records(run_dir / "events.jsonl")
               if r["event"] == "group_started"]
    assert started == [str(run_dir / "attempt_0"), str(run_dir / "attempt_2")]
    assert "planted-text" not in sup.err.text()
