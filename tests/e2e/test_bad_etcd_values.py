"""A bad value in etcd fails the job cleanly on the node that reads it, or is ignored.

Real supervisors on a real etcd; the test writes what a broken or hostile peer could:
``ctl/round = {"round": "x"}`` must end the job with one line naming the key (the usual
job-failed line and event, exit 1, no traceback) and close it for the other nodes; a key
under ``ctl/`` that is not UTF-8 is ignored (the watch goes on and the next key still
counts). Regression for the second security review's finding 3 (issue 25).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import anyio
import pytest

from supervisor.rendezvous.etcd.keys import Keys
from supervisor.rendezvous.etcd.wire.client import EtcdClient, _b64
from tests.support.daemon import supervisor
from tests.support.etcd import EtcdMember
from tests.support.paths import FAKE_WORKER

pytestmark = pytest.mark.etcd


def _line(server: EtcdMember, run_id: str, tmp_path: Path, nnodes: str = "1") -> list[str]:
    return ["--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "etcd",
            "--rdzv-endpoint", server.endpoint, "--rdzv-id", run_id, "--health-port", "0",
            "--log-dir", str(tmp_path / "logs"), "--event-log",
            str(tmp_path / "events.jsonl"), "--shutdown-timeout", "5",
            FAKE_WORKER, "--hang"]


def _events(tmp_path: Path) -> list[dict[str, object]]:
    path = tmp_path / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def test_a_malformed_round_fails_the_job_in_one_line_and_closes_it(
    server: EtcdMember, tmp_path: Path
) -> None:
    run_id = f"bad-{uuid.uuid4().hex[:8]}"
    keys = Keys(run_id)
    async with supervisor(_line(server, run_id, tmp_path)) as sup, \
            EtcdClient([server.endpoint]) as client:
        await sup.out.expect(r"^ready 0 ")
        await client.put(keys.round, json.dumps({"round": "x"}))
        code = await sup.wait(30)
        closed = await client.get(keys.closed)
    log = sup.err.text()
    assert code == 1, log
    assert "Traceback" not in log
    named = [line for line in sup.err.lines if f"etcd key {keys.round} holds a malformed" in line]
    assert named, log
    assert any("job failed" in line for line in sup.err.lines), log
    assert closed is not None and keys.round in json.loads(closed.value)["reason"]
    finished = [e for e in _events(tmp_path) if e["event"] == "finished"]
    assert finished and finished[0]["exit_code"] == 1
    assert keys.round in str(finished[0]["reason"])


async def test_a_malformed_round_written_before_start_fails_cleanly(
    server: EtcdMember, tmp_path: Path
) -> None:
    run_id = f"bad-{uuid.uuid4().hex[:8]}"
    async with EtcdClient([server.endpoint]) as client:
        await client.put(Keys(run_id).round, b'{"round": 1, "reason": "\xff"}')
    async with supervisor(_line(server, run_id, tmp_path)) as sup:
        code = await sup.wait(30)
    assert code == 1, sup.err.text()
    assert "Traceback" not in sup.err.text()
    assert any(f"etcd key {Keys(run_id).round} holds a malformed" in line
               for line in sup.err.lines), sup.err.text()


async def test_a_key_that_is_not_utf8_is_ignored_and_the_watch_goes_on(
    server: EtcdMember, tmp_path: Path
) -> None:
    run_id = f"bad-{uuid.uuid4().hex[:8]}"
    keys = Keys(run_id)
    async with supervisor(_line(server, run_id, tmp_path)) as sup, \
            EtcdClient([server.endpoint]) as client:
        await sup.out.expect(r"^ready 0 ")
        stray = keys.ctl.encode() + b"\xff\xfe"
        await client.call("/v3/kv/put", {"key": _b64(stray), "value": _b64(b"\xff")})
        # the next key on the same watch still counts: the job closes with its reason
        await client.put(keys.closed, json.dumps({"ok": False, "reason": "closed by test"}))
        with anyio.fail_after(30):
            code = await sup.wait(30)
    log = sup.err.text()
    assert code == 1, log
    assert "Traceback" not in log and "UnicodeDecodeError" not in log
    assert "closed by test" in log
