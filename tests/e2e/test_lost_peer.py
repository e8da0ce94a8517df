"""A failure that comes from a lost peer is a membership change (issue 53, item 2).

Real supervisors on this machine, against a real etcd (or a c10d host's), with fake
workers linked to rank 0 over TCP (``fake_worker.py --link``: a collective's connections;
a broken link exits 1). A node's supervisor is SIGKILLed (its workers die with it): the
survivors' ranks fail on the broken link before the lost node's lease expires, the
survivors ask the round's other members (``Rendezvous.check_peers``) and find its health
endpoint refusing connections: no restart budget is used, the log names the node and how
it was seen, and goodput's cause is ``node_lost``. A local failure with every peer alive
still uses the budget.
"""

from __future__ import annotations

import re
import signal
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest

from supervisor.core.peers import CHECK_BOUND
from tests.support.daemon import supervisor
from tests.support.etcd import EtcdMember, etcd_binary
from tests.support.nodes import (
    LOCAL,
    SHOWN,
    Env,
    Node,
    assert_one_group,
    cluster,
    read_key,
    stop_all,
)
from tests.support.paths import FAKE_WORKER
from tests.support.ports import free_port
from tests.support.processes import wait_dead

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(120)]

LINKED = ("--link",)
BUDGET = ("--max-restarts", "3")


def node_id(node: Node) -> str:
    """The node's rendezvous id (its place in its first round's members)."""
    first = node.events("rendezvous")[0]
    return str(first["members"][int(first["group_rank"])])


async def linked(nodes: Sequence[Node], groups: Sequence[dict[int, Env]]) -> None:
    """Until every worker of each node's group (``groups``: its env lines) is linked to
    rank 0: ``linked N`` lines after the group's first line (an earlier group's links, of
    a round that a join outdated, do not count)."""
    with anyio.fail_after(30):
        for node, group in zip(nodes, groups, strict=True):
            port = f"MASTER_PORT={group[0]['MASTER_PORT']} "
            lines = node.sup.out.lines
            while True:
                first = next(i for i, ln in enumerate(lines) if port in ln + " ")
                if sum(ln.startswith("linked ") for ln in lines[first:]) >= LOCAL:
                    break
                await node.sup.out.next_line()


async def status(node: Node) -> dict[str, Any]:
    """The node's ``/status``."""
    port = await node.sup.health_port()
    async with aiohttp.ClientSession() as session, session.get(
            f"http://127.0.0.1:{port}/status") as resp:
        return dict(await resp.json())


async def assert_lost_without_budget(survivor: Node, lost: str, since: float) -> None:
    """``survivor`` saw ``lost`` gone by its refusing health endpoint and used no budget
    (since ``since``, monotonic: the forming of the job may restart, as joins come)."""
    (event,) = survivor.events("peer_lost")
    assert list(event["nodes"]) == [lost] and "refused the connection" in event["nodes"][lost]
    assert event["budget_used"] is False
    checked = survivor.events("peers_checked")[0]
    assert float(checked["seconds"]) <= CHECK_BOUND + 0.5  # the bound, plus scheduling
    lines = [ln for ln in survivor.sup.err.lines if "a membership change, no restart used" in ln]
    assert len(lines) == 1 and f"node {lost} (its health endpoint at http" in lines[0], lines
    assert not [e for e in survivor.events("restart_scheduled") if float(e["mono"]) > since]
    doc = await status(survivor)
    last = doc["goodput"]["last_recovery"]
    assert last["cause"] == "node_lost" and f"node {lost}" in last["message"], last
    assert doc["last_failure"]["kind"] == "node_lost", doc["last_failure"]


async def test_two_nodes_a_killed_peer_costs_no_restart(tmp_path: Path, server: EtcdMember) -> None:
    async with cluster(tmp_path, server.endpoint, nnodes="1:2", flags=BUDGET, worker=LINKED) as job:
        a, b = await job.start(2)
        groups = await job.groups([a, b], 2 * LOCAL, timeout=60)
        assert_one_group(groups, 2)
        await linked([a, b], groups)
        lost, before = node_id(b), await read_key(server.endpoint, job.run_id, "ctl/restarts")
        killed = time.monotonic()
        b.sup.signal(signal.SIGKILL)
        assert_one_group([await a.group(LOCAL, timeout=30)], 1)
        await assert_lost_without_budget(a, lost, killed)
        assert await read_key(server.endpoint, job.run_id, "ctl/restarts") == before
        await stop_all([a])


async def test_three_nodes_both_survivors_keep_the_budget(tmp_path: Path,
                                                          server: EtcdMember) -> None:
    # a last call long enough for the three to form one round: a 2-node round first would
    # break its links when the third joins, and a node that sees its rank fail before it
    # sees the join counts that failure (a forming job's churn, not this test's case)
    conf = "last_call_timeout=5,lease_ttl=2"
    async with cluster(tmp_path, server.endpoint, nnodes="2:3", conf=conf, flags=BUDGET,
                       worker=LINKED) as job:
        nodes = await job.start(3)
        groups = await job.groups(nodes, 3 * LOCAL, timeout=60)
        assert_one_group(groups, 3)
        await linked(nodes, groups)
        a, b, c = nodes
        lost, before = node_id(c), await read_key(server.endpoint, job.run_id, "ctl/restarts")
        killed = time.monotonic()
        c.sup.signal(signal.SIGKILL)
        assert_one_group(await job.groups([a, b], 2 * LOCAL, timeout=30), 2)
        for survivor in (a, b):
            await assert_lost_without_budget(survivor, lost, killed)
        assert await read_key(server.endpoint, job.run_id, "ctl/restarts") == before
        await stop_all([a, b])


async def test_a_local_failure_with_every_peer_alive_uses_the_budget(
        tmp_path: Path, server: EtcdMember) -> None:
    failing = ("--link", "--exit", "1", "--fail-rank", "3", "--fail-attempts", "1")
    # a lease long enough that no peer is evicted on a loaded machine (a keepalive starved
    # past a 2 s TTL: then the peer's lease is truly gone, and the check says so)
    conf = "last_call_timeout=0.5,lease_ttl=10"
    async with cluster(tmp_path, server.endpoint, nnodes="2", conf=conf, flags=BUDGET,
                       worker=failing) as job:
        nodes = await job.start(2)
        assert_one_group(await job.groups(nodes, 2 * LOCAL, timeout=60), 2)
        assert_one_group(await job.groups(nodes, 2 * LOCAL, timeout=30), 2)  # the next one
        for node in nodes:
            checked = node.events("peers_checked")
            assert checked and all(not e.get("lost") for e in checked), checked
            assert not node.events("peer_lost")
        restarts = await read_key(server.endpoint, job.run_id, "ctl/restarts")
        assert restarts is not None and restarts["count"] >= 1
        await stop_all(nodes)


# ---------------------------------------------------------------------- c10d


class C10dNodes:
    """Supervisors of one c10d job on this machine (the first to bind the port hosts)."""

    def __init__(self, stack: AsyncExitStack, root: Path) -> None:
        self.stack = stack
        self.root = root
        self.run_id = f"lp-{uuid.uuid4().hex[:10]}"
        self.endpoint = f"localhost:{free_port()}"
        self.nodes: list[Node] = []

    async def start(self, nnodes: str, worker: Sequence[str], conf: str = "",
                    health: Sequence[str] = ("--health-port", "0")) -> Node:
        log_dir = self.root / f"node{len(self.nodes)}"
        args = [f"--nnodes={nnodes}", f"--nproc-per-node={LOCAL}", f"--rdzv-id={self.run_id}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={self.endpoint}",
                "--rdzv-conf", f"last_call_timeout=0.5,lease_ttl=2{conf}",
                *health, "--log-dir", str(log_dir), "--shutdown-timeout", "5",
                *BUDGET, FAKE_WORKER, "--print-env", SHOWN, *worker]
        spawned = time.monotonic()
        sup = await self.stack.enter_async_context(supervisor(args))
        node = Node(sup, log_dir, self.run_id, spawned)
        self.nodes.append(node)
        if len(self.nodes) == 1:  # the first one hosts: the others start once it serves
            await sup.err.expect("this node hosts the rendezvous", timeout=30)
        return node

    def pids(self) -> set[int]:
        etcd = {int(m[1]) for n in self.nodes for line in n.sup.err.lines
                if (m := re.search(r"started etcd \(pid (\d+)\)", line))}
        return etcd.union(*(n.worker_pids() for n in self.nodes))


@asynccontextmanager
async def c10d_nodes(tmp_path: Path) -> AsyncIterator[C10dNodes]:
    etcd_binary()  # skips when etcd is not installed
    job = C10dNodes(AsyncExitStack(), tmp_path)
    try:
        async with job.stack:
            yield job
    finally:
        with anyio.CancelScope(shield=True):
            await wait_dead(sorted(job.pids()), timeout=10)


async def test_c10d_a_killed_client_node_costs_the_host_no_restart(tmp_path: Path) -> None:
    async with c10d_nodes(tmp_path) as job:
        host = await job.start("1:2", LINKED)
        other = await job.start("1:2", LINKED)
        groups = [await node.group(2 * LOCAL, timeout=30) for node in (host, other)]
        assert_one_group(groups, 2)
        await linked([host, other], groups)
        lost = node_id(other)
        killed = time.monotonic()
        other.sup.signal(signal.SIGKILL)
        assert_one_group([await host.group(LOCAL, timeout=30)], 1)
        await assert_lost_without_budget(host, lost, killed)
        await stop_all([host])



@pytest.mark.parametrize("seen", ["seen", "unseen"])
async def test_c10d_the_hosts_death_ends_the_job_in_a_few_clear_lines(tmp_path: Path,
                                                                      seen: str) -> None:
    """Issue 53, item 5: the survivor says once that the rendezvous host is gone, never
    that it restarts, in short lines that do not speak of an etcd the user never set up;
    also when the lost-peer check cannot see the host go (it serves no health endpoint:
    the failure is then accounted as a failure, whose restart never comes)."""
    health = ("--health-port", "0") if seen == "seen" else ("--no-health",)
    async with c10d_nodes(tmp_path) as job:
        host = await job.start("2", LINKED, conf=",read_timeout=2", health=health)
        other = await job.start("2", LINKED, conf=",read_timeout=2")
        groups = [await node.group(2 * LOCAL, timeout=30) for node in (host, other)]
        assert_one_group(groups, 2)
        await linked([host, other], groups)
        host.sup.signal(signal.SIGKILL)
        code = await other.sup.wait(timeout=60)
        assert code not in (0, None)
        # "TIME LEVEL logger: message": the messages (the job's own, not the c10d warning
        # about authentication it logged at the start)
        lines = [ln.split(": ", 1)[1] for ln in other.sup.err.lines
                 if (" WARNING " in ln or " ERROR " in ln) and "authentication" not in ln]
        assert not [ln for ln in lines if "restarting the worker group" in ln], lines
        assert len(set(lines)) == len(lines), lines
        assert all(len(ln) <= 300 for ln in lines), lines
        assert not [ln for ln in lines if "etcd" in ln.lower()], lines
        assert len(lines) <= 7, lines  # the outage, the failure, the loss, its cost, the end
        assert any(f"rendezvous host {job.endpoint}" in ln for ln in lines), lines
        assert bool(other.events("peer_lost")) == (seen == "seen")
