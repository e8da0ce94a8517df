"""A graceful leave told to the peers directly (issue 27; docs/rendezvous.md, "Graceful
leave"), end to end: real daemons, a real etcd, real HTTP between the nodes.

While etcd commits nothing (here: its process stopped with SIGSTOP, as a cluster whose
raft leader is cut off commits nothing until an election), a node that leaves tells its
peers on their health endpoints; they check with it and stop their workers without
waiting for etcd, and re-form once etcd answers again. A notice that the named node does
not confirm changes nothing.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest

from tests.support.etcd import EtcdMember
from tests.support.nodes import LOCAL, Cluster, Node, assert_one_group, cluster, stop_all
from tests.support.processes import pid_alive

etcd = pytest.mark.etcd
# TTL 6: the peers' leases must outlive the freeze (the leave, its notice, the check, the
# grace) plus one refresh interval, so that only the leaver is missing afterwards
CONF = "last_call_timeout=0.5,lease_ttl=6"


async def until(what: str, check: Callable[[], Any], timeout: float = 15.0) -> Any:
    """Poll a node's event log (a file) until ``check`` holds; bounded."""
    with anyio.fail_after(timeout):
        while not (found := check()):
            await anyio.sleep(0.05)
    assert found, what
    return found


async def status(port: int) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, \
            session.get(f"http://127.0.0.1:{port}/status") as resp:
        doc: dict[str, Any] = await resp.json()
    return doc


async def post_notice(port: int, body: bytes) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.post(
            f"http://127.0.0.1:{port}/leave-notice", data=body,
            headers={"Content-Type": "application/json"}) as resp:
        return resp.status, json.loads(await resp.read())


async def three_serving(job: Cluster) -> tuple[list[Node], list[int]]:
    """Three nodes running one group, each serving HTTP; and their health ports."""
    nodes = await job.start(3)
    await job.groups(nodes, 3 * LOCAL)
    return nodes, [await node.sup.serving() for node in nodes]


def told(node: Node, after: float) -> list[dict[str, Any]]:
    return [e for e in node.events("membership_changed")
            if float(e["mono"]) > after and "told this node directly" in e["reason"]]


@etcd
async def test_a_leave_while_etcd_commits_nothing_is_told_to_the_peers_directly(
        tmp_path: Path, server: EtcdMember) -> None:
    async with cluster(tmp_path, server.endpoint, nnodes="2:3", conf=CONF) as job:
        nodes, ports = await three_serving(job)
        leaver, others = nodes[2], nodes[:2]
        rdzv = (await status(ports[2]))["rendezvous"]
        leaver_id = rdzv["members"][rdzv["group_rank"]]
        assert server.process is not None
        frozen = time.monotonic()
        server.process.send_signal(signal.SIGSTOP)
        try:
            leaver.sup.signal(signal.SIGTERM)
            # seen while etcd is still stopped: only the notice can have told them
            changes = [await until("the leave told", lambda n=n: told(n, frozen))
                       for n in others]
            stopped = [await until("the workers stopped",
                                   lambda n=n: [e for e in n.events("group_stopped")
                                                if float(e["mono"]) > frozen])
                       for n in others]
        finally:
            server.process.send_signal(signal.SIGCONT)
        assert await leaver.sup.wait(timeout=20) == 128 + signal.SIGTERM
        after = await job.groups(others, 2 * LOCAL, timeout=30)
        assert_one_group(after, 2)
        assert all(g[0]["TORCHELASTIC_RESTART_COUNT"] == "0" for g in after)  # no budget used
        for node, change, stop in zip(others, changes, stopped, strict=True):
            (heard,) = [e for e in node.events("peer_left_told") if float(e["mono"]) > frozen]
            assert heard["node"] == leaver_id
            assert "node(s) lost" in change[0]["reason"]  # goodput: node_lost
            assert stop[0]["mono"] >= change[0]["mono"]
        (left,) = leaver.events("rendezvous_left")
        assert left["round"] >= 0
        await stop_all(others)


@etcd
async def test_a_notice_the_named_node_does_not_confirm_changes_nothing(
        tmp_path: Path, server: EtcdMember) -> None:
    async with cluster(tmp_path, server.endpoint, nnodes="3", conf=CONF) as job:
        nodes, ports = await three_serving(job)
        docs = [await status(p) for p in ports]
        members, round_ = docs[0]["rendezvous"]["members"], docs[0]["rendezvous"]["round"]
        i = next(i for i, d in enumerate(docs) if d["rendezvous"]["group_rank"] == 0)
        target, victim = ports[i], nodes[i]
        pids = [n.current_pids() for n in nodes]
        since = time.monotonic()
        # group rank 0 is told by both others: forge a notice that one of them left
        teller = members[1]
        body = {"run_id": job.run_id, "node": teller, "round": round_}
        assert await post_notice(target, json.dumps(body).encode()) == (
            202, {"accepted": True, "node": teller, "round": round_})
        await victim.sup.err.expect(rf"{teller} did not confirm that it left round {round_}",
                                    timeout=10)
        # refused at once, with the reason: garbage, another job, another round
        for bad, code in ((b"{", 400), (b"[]", 400),
                          (json.dumps({**body, "run_id": "other"}).encode(), 400),
                          (json.dumps({**body, "round": round_ + 5}).encode(), 409),
                          (json.dumps({**body, "node": "stranger"}).encode(), 409),
                          (b"x" * 5000, 413)):
            status_code, answer = await post_notice(target, bad)
            assert status_code == code, (bad[:40], answer)
        async with aiohttp.ClientSession() as session, \
                session.get(f"http://127.0.0.1:{target}/metrics") as resp:
            metrics = await resp.text()
        # the body that is not JSON and the one too large never reach the rendezvous
        for outcome, count in (("received", 5), ("refused", 4), ("confirmed", 0),
                               ("unconfirmed", 1)):
            assert (f'elastic_supervisor_leave_notices_total{{outcome="{outcome}"}} '
                    f'{count:.1f}') in metrics, outcome
        assert [n.current_pids() for n in nodes] == pids
        assert all(pid_alive(p) for group in pids for p in group)
        assert not any(e for n in nodes for e in n.events("membership_changed")
                       if float(e["mono"]) > since)
        await stop_all(nodes)
