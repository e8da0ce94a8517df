"""The job-wide status (every node's summary in etcd) is kept for c10d jobs too, in the
etcd the host runs (it used to be kept for ``--rdzv-backend etcd`` only)."""

from __future__ import annotations

import signal
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest

from supervisor.rendezvous.etcd.summary import read_summaries
from supervisor.rendezvous.etcd.wire.client import EtcdClient
from tests.support.daemon import supervisor
from tests.support.etcd import etcd_binary
from tests.support.paths import FAKE_WORKER
from tests.support.ports import free_port

pytestmark = pytest.mark.etcd


async def wait_summaries(client: EtcdClient, run_id: str) -> list[dict[str, Any]]:
    """Read the summaries until this node's says it runs (it writes on its changes)."""
    with anyio.fail_after(30):
        while True:
            try:
                rows = await read_summaries(client, run_id)
            except OSError:
                rows = []
            if any(r.get("state") == "running" for r in rows):
                return rows
            await anyio.sleep(0.2)  # etcd has no "wait until this predicate" call


async def test_a_c10d_node_publishes_its_summary_in_the_hosted_etcd(tmp_path: Path) -> None:
    etcd_binary()  # skips when etcd is not installed
    port = free_port()
    run_id = f"c10d-{uuid.uuid4().hex[:10]}"
    args = ["--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
            "--health-port", "0", "--log-dir", str(tmp_path / "logs"),
            "--shutdown-timeout", "5", FAKE_WORKER, "--hang"]
    async with supervisor(args) as sup:
        await sup.out.expect(r"^ready 0 ")
        async with EtcdClient([f"http://127.0.0.1:{port}"]) as client:
            rows = await wait_summaries(client, run_id)
        assert len(rows) == 1 and rows[0]["health_url"].startswith("http://")
        sup.signal(signal.SIGTERM)
        assert await sup.wait() == 128 + signal.SIGTERM
