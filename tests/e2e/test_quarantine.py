"""A bad node quarantines itself and a spare takes its place: real daemons, a real etcd.

Four supervisors with distinct node ids, MIN = MAX = 3, one worker each; the fourth
waits as a spare. The bad node's worker exits 1 once the test opens the gate, and at once
on every later attempt.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import anyio
import msgspec
import pytest

from supervisor.core import nodehealth as nh
from supervisor.core.nodehealth import EXIT_QUARANTINED
from supervisor.rendezvous.etcd.wire.client import EtcdClient
from tests.support.etcd import EtcdMember, etcd_binary
from tests.support.healing import (
    HealingJob,
    HealNode,
    exit_code,
    group_without,
    healing_job,
    worker_args,
)
from tests.support.ports import free_port

pytestmark = pytest.mark.etcd

HEAL = ["--max-restarts", "3", "--max-node-failures", "2"]



async def start_three_and_a_spare(job: HealingJob) -> tuple[HealNode, list[HealNode]]:
    """n0 (bad), n1, n2 form the group; n3 then waits as a spare."""
    bad = await job.start("n0", bad=True)
    if job.backend == "c10d":  # n0 hosts: it binds the endpoint before the others start
        await bad.sup.err.expect("this node hosts the rendezvous", timeout=30)
    healthy = [await job.start("n1"), await job.start("n2")]
    for node in (bad, *healthy):
        await node.sup.out.expect(r"^ready \d n\d world 3 ", timeout=30)
    spare = await job.start("n3")
    await spare.sup.err.expect("waiting as a spare", timeout=30)
    return bad, [*healthy, spare]


async def test_a_bad_node_quarantines_itself_and_the_spare_takes_its_place(
    tmp_path: Path, server: EtcdMember
) -> None:
    async with healing_job(tmp_path, server.endpoint, flags=HEAL) as job:
        bad, others = await start_three_and_a_spare(job)
        await job_status_shows(job, "n3", "spare")
        job.bad_gate.touch()
        assert await exit_code(bad, timeout=60) == EXIT_QUARANTINED
        assert "quarantining node n0: 2 failure(s) of this node" in bad.sup.err.text()
        assert [e["node"] for e in bad.events("node_quarantined")] == ["n0"]
        # the spare trains on in the group, with the two healthy nodes
        await group_without(bad, others)
        await job_status_shows(job, "n0", "quarantined")
        job.done.touch()
        for node in others:
            assert await exit_code(node, timeout=60) == 0, node.sup.err.text()
            assert not node.events("node_quarantined")
        # one restart: the first failure; the second quarantined the node (no budget)
        assert (await job.key("ctl/restarts"))["count"] == 1
        assert (await job.key("health/n0"))["quarantined"]["reason"].startswith("2 failure")
        assert any(e["event"] == "spare_admitted" for n in others for e in n.events())


async def test_c10d_a_host_that_quarantines_serves_the_rendezvous_until_the_job_ends(
    tmp_path: Path
) -> None:
    etcd_binary()  # skips when etcd is not installed
    endpoint = f"127.0.0.1:{free_port()}"
    async with healing_job(tmp_path, endpoint, flags=HEAL, backend="c10d") as job:
        bad, others = await start_three_and_a_spare(job)  # n0 hosts
        job.bad_gate.touch()
        await bad.sup.err.expect("keeps serving the rendezvous at .* until the job ends",
                                 timeout=60)
        assert [e["node"] for e in bad.events("node_quarantined")] == ["n0"]
        await group_without(bad, others)
        job.done.touch()
        for node in others:
            assert await exit_code(node, timeout=60) == 0, node.sup.err.text()
        assert await exit_code(bad, timeout=60) == EXIT_QUARANTINED


async def test_a_failure_that_follows_the_rank_quarantines_no_more_than_the_cap(
    tmp_path: Path, server: EtcdMember
) -> None:
    worker = worker_args(tmp_path, "--fail-rank", "1")  # a bug of rank 1, on any node
    job_flags = ["--max-restarts", "3", "--max-node-failures", "2", "--max-quarantined", "1"]
    async with healing_job(tmp_path, server.endpoint, flags=job_flags, worker=worker) as job:
        job.bad_gate.touch()
        nodes = [await job.start(f"n{i}") for i in range(4)]
        codes = [await exit_code(node, timeout=90) for node in nodes]
        held = [n.name for n in nodes if n.events("node_quarantined")]
        assert len(held) <= 1, held
        assert codes.count(EXIT_QUARANTINED) == len(held)
        assert sorted(c for c in codes if c != EXIT_QUARANTINED) == [1] * (4 - len(held))
        assert (await job.key("ctl/restarts"))["count"] == 3  # the budget, as today
        verdicts = [e["verdict"] for n in nodes for e in n.events("node_failure")]
        assert "follows_rank" in verdicts or "capped" in verdicts, verdicts


async def test_failures_older_than_the_window_do_not_count(
    tmp_path: Path, server: EtcdMember
) -> None:
    flags = [*HEAL, "--node-failure-window", "600"]
    async with healing_job(tmp_path, server.endpoint, nnodes="1:1", flags=flags) as job:
        await seed_failure(job, "n0", age=700.0)  # outside the window
        job.bad_gate.touch()
        node = await job.start("n0", bad=True)
        assert await exit_code(node, timeout=60) == EXIT_QUARANTINED
        reason = (await job.key("health/n0"))["quarantined"]["reason"]
        assert "round 0" in reason and "seeded" not in reason, reason
        assert (await job.key("ctl/restarts"))["count"] == 1  # K=2: one failure used budget


async def test_a_recent_failure_in_the_record_counts(tmp_path: Path, server: EtcdMember) -> None:
    async with healing_job(tmp_path, server.endpoint, nnodes="1:1", flags=HEAL) as job:
        await seed_failure(job, "n0", age=10.0)  # inside the window: this is the K-th
        job.bad_gate.touch()
        node = await job.start("n0", bad=True)
        assert await exit_code(node, timeout=60) == EXIT_QUARANTINED
        assert await job.key("ctl/restarts") is None  # quarantined at the first failure


async def test_a_quarantined_node_started_again_stays_out_until_cleared(
    tmp_path: Path, server: EtcdMember
) -> None:
    async with healing_job(tmp_path, server.endpoint, nnodes="1:1", flags=HEAL) as job:
        await seed_failure(job, "n0", age=10.0, held=True)
        job.done.touch()
        node = await job.start("n0")
        await node.sup.err.expect("node n0 is quarantined .* stays out until its record is "
                                  "cleared", timeout=30)
        assert not node.worker_pids()
        cleared = await run_cli("node", "clear", "--rdzv-endpoint", server.endpoint,
                                "--rdzv-id", job.run_id, "n0")
        assert cleared.returncode == 0 and "cleared node n0" in cleared.stdout
        await node.sup.err.expect("quarantine cleared, joining", timeout=30)
        assert await exit_code(node, timeout=60) == 0
        kinds = [e["event"] for e in node.events()]
        assert kinds.index("node_held") < kinds.index("node_cleared") < kinds.index(
            "group_started")


async def seed_failure(job: HealingJob, node: str, *, age: float, held: bool = False) -> None:
    """Put a record for ``node`` in etcd as if it had failed ``age`` seconds ago."""
    at = time.time() - age
    sig = nh.Signature("exited", local_rank=0, exit_code=1)
    record = nh.NodeRecord(node, failures=(nh.NodeFailure(at, 99, sig, "seeded"),))
    if held:
        record = nh.quarantined(record, "seeded quarantine", at)
    async with EtcdClient([job.endpoint]) as client:
        await client.put(f"/elastic-supervisor/{job.run_id}/health/{node}",
                         msgspec.json.encode(record))


async def job_status_shows(job: HealingJob, node: str, state: str) -> None:
    """``elastic-supervisor status --rdzv-endpoint`` lists ``node`` in ``state`` (each node
    writes its summary at most once a second: asked again until then, bounded)."""
    with anyio.fail_after(20):
        while True:
            shown = await run_cli("status", "--rdzv-endpoint", job.endpoint, "--rdzv-id",
                                  job.run_id)
            if any(line.split()[:1] == [node] and f" {state} " in line
                   for line in shown.stdout.splitlines()):
                return


async def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return await anyio.to_thread.run_sync(lambda: subprocess.run(
        [sys.executable, "-m", "supervisor", *args], capture_output=True, text=True,
        timeout=30, check=False))
