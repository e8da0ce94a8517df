"""Healing with a real collective job: the healthy ranks' all-reduce breaks when the bad
node's rank dies, so they fail too; those failures are remote consequences (no budget,
no count), and only the bad node is quarantined."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support import deps
from tests.support.etcd import EtcdMember
from tests.support.healing import exit_code, healing_job
from tests.support.paths import TESTS

deps.need_module("torch")  # skips with how to install it (fails under .ci/run)
pytestmark = [pytest.mark.etcd, pytest.mark.torch]

GLOO_WORKER = str(TESTS / "workers" / "gloo_healing_worker.py")
CHECK = str(TESTS / "workers" / "node_check.py")



async def test_a_gloo_job_heals_without_spending_the_healthy_nodes_budget(
    tmp_path: Path, server: EtcdMember
) -> None:
    worker = [GLOO_WORKER, "--bad-gate", str(tmp_path / "bad-gate"),
              "--done", str(tmp_path / "done")]
    flags = ["--max-restarts", "3", "--max-node-failures", "2"]
    async with healing_job(tmp_path, server.endpoint, flags=flags, worker=worker) as job:
        # the bad node's check takes 6 s before it rejoins after its own failure, so the
        # healthy ranks' all-reduce (2 s step timeout) fails first: remote consequences;
        # they re-form with the spare at once, and the bad node comes back as a spare
        slow_check = ["--node-check", f"{sys.executable} {CHECK} --sleep 6"]
        bad = await job.start("n0", bad=True, flags=slow_check)
        healthy = [await job.start("n1"), await job.start("n2")]
        for node in (bad, *healthy):
            await node.sup.out.expect(r"^ready \d n\d world 3$", timeout=90)
        spare = await job.start("n3")
        await spare.sup.err.expect("waiting as a spare", timeout=60)
        job.bad_gate.touch()
        await spare.sup.out.expect(r"^ready \d n3 world 3$", timeout=90)
        await bad.sup.err.expect("waiting as a spare", timeout=60)
        job.done.touch()
        for node in (*healthy, spare):
            assert await exit_code(node, timeout=90) == 0, node.sup.err.text()
            assert not node.events("node_quarantined")
            assert not node.events("restart_scheduled")  # no budget used by healthy nodes
        # the first to notice its broken all-reduce knew it for n0's consequence (the
        # other may then be stopped by the new round before its own worker fails)
        remote = [e["node"] for n in healthy for e in n.events("remote_failure")]
        assert remote and set(remote) == {"n0"}, remote
        assert await exit_code(bad, timeout=30) == 0  # the job ended well without it
        assert len(bad.events("restart_scheduled")) == 1
        assert (await job.key("ctl/restarts"))["count"] == 1
