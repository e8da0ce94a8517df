"""The job-wide ``status`` view shows what siblings publish without trusting it.

Regression (issue 25, finding 5): terminal escapes in a sibling's summary reached the
terminal raw; one bad row (a list for a dict, an infinite number, a huge integer with
``--json``, a key that is not UTF-8) failed the whole view with a traceback; three 1 MB
fields made 4 MB of output. Since issue 52 a row whose text is not printable is skipped
like the other malformed ones (summaries are printable by ``decode``'s rules). A real etcd
holds the rows; the real command reads them.
"""

from __future__ import annotations

import json
import os
import sys

import anyio
import pytest

from supervisor.rendezvous.etcd.summary import summary_prefix
from supervisor.rendezvous.etcd.wire.client import EtcdClient, _b64
from tests.support.etcd import EtcdMember
from tests.support.paths import REPO

pytestmark = pytest.mark.etcd
ESCAPES = "\x1b]0;owned\x07\x1b[2J\x1b[H\u202e"


def _row(node: str, **fields: object) -> dict[str, object]:
    return {"node_id": node, "node_rank": 0, "host": "h", "state": "running", "attempt": 0,
            "restarts": 0, "max_restarts": 3, "world_size": 2, "health_url": None,
            "last_failure": None, "goodput": None, **fields}


async def _publish(server: EtcdMember, run_id: str) -> None:
    prefix = summary_prefix(run_id)
    rows: dict[bytes, bytes] = {
        b"good": json.dumps(_row("good", node_rank=0)).encode(),
        b"escaped": json.dumps(_row("escaped", node_rank=1, host=ESCAPES,
                                    last_failure=ESCAPES * 3)).encode(),
        b"list": json.dumps(_row("list", goodput=[1, 2])).encode(),
        b"inf": json.dumps(_row("inf", node_rank=2)).replace('"node_rank": 2',
                                                             '"node_rank": Infinity').encode(),
        b"huge": json.dumps(_row("huge", restarts=10**400)).encode(),
        b"big": json.dumps(_row("big", host="x" * 200_000, last_failure="y" * 200_000,
                                state="z" * 200_000)).encode(),
        b"\xff\xfe": json.dumps(_row("bad-key")).encode(),
        b"not-json": b"\xff{",
    }
    async with EtcdClient([server.endpoint]) as client:
        for node, value in rows.items():
            await client.call("/v3/kv/put", {"key": _b64(prefix.encode() + node),
                                             "value": _b64(value)})


async def _status(server: EtcdMember, run_id: str, *extra: str) -> tuple[int, str, str]:
    done = await anyio.run_process(
        [sys.executable, "-m", "supervisor", "status", "--rdzv-endpoint", server.endpoint,
         "--rdzv-id", run_id, *extra], check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    return done.returncode, done.stdout.decode(), done.stderr.decode()


@pytest.mark.parametrize("extra", [(), ("--json",)])
async def test_hostile_rows_are_skipped_counted_and_stripped(
    server: EtcdMember, extra: tuple[str, ...]
) -> None:
    await _publish(server, "job")
    code, out, err = await _status(server, "job", *extra)
    assert code == 0, err
    assert "Traceback" not in err
    assert "skipped 7 malformed node summary(ies)" in err, err
    for char in "\x1b\x07\u202e":
        assert char not in out
    assert len(out) < 16 << 10  # 600 kB of fields published: a few KiB shown
    if extra:
        rows = json.loads(out)
        assert [r["node_id"] for r in rows] == ["good"]
        assert "\\u001b" not in out  # the escaped row is not shown, not even escaped
    else:
        lines = out.splitlines()
        assert lines[0] == "job job: 1 node(s)"
        assert not any(line.startswith("escaped") for line in lines)
        assert all(len(line) < 400 for line in lines)
