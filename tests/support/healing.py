"""Helpers of the healing tests: supervisor daemons with distinct node ids on one etcd.

``HealingJob`` starts nodes ``n0``, ``n1``, ... of one job (``--rdzv-conf node_id=nK``),
each a real ``python -m supervisor run`` with its own log dir and health port, and reads
their ``events.jsonl``. Tests synchronise on the supervisors' log lines and on files.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio

from supervisor.rendezvous.etcd.wire.client import EtcdClient
from tests.support.daemon import Supervised, supervisor
from tests.support.eventlog import read_events
from tests.support.paths import TESTS
from tests.support.processes import wait_dead

HEALING_WORKER = str(TESTS / "workers" / "healing_worker.py")
TTL = 2


class HealNode:
    """One supervisor daemon of the job."""

    def __init__(self, name: str, sup: Supervised, log_dir: Path, run_id: str) -> None:
        self.name = name
        self.sup = sup
        self.log_dir = log_dir
        self.run_id = run_id

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return read_events(self.log_dir / self.run_id / "events.jsonl", kind)

    def worker_pids(self) -> set[int]:
        return {int(pid) for e in self.events("group_started") for pid in e["pids"].values()}


class HealingJob:
    """Nodes of one job; see ``healing_job``."""

    def __init__(self, stack: AsyncExitStack, root: Path, endpoint: str, nnodes: str,
                 flags: Sequence[str], worker: Sequence[str], conf: str,
                 backend: str = "etcd") -> None:
        self.stack = stack
        self.root = root
        self.endpoint = endpoint
        self.nnodes = nnodes
        self.flags = list(flags)
        self.worker = list(worker)
        self.conf = conf
        self.backend = backend
        self.run_id = f"heal-{uuid.uuid4().hex[:10]}"
        self.nodes: list[HealNode] = []
        self.bad_gate = root / "bad-gate"
        self.done = root / "done"

    async def start(self, name: str, *, bad: bool = False, flags: Sequence[str] = (),
                    local: int = 1) -> HealNode:
        log_dir = self.root / name
        args = [
            "--rdzv-backend", self.backend, "--rdzv-endpoint", self.endpoint,
            "--rdzv-id", self.run_id, "--nnodes", self.nnodes,
            "--nproc-per-node", str(local),
            "--rdzv-conf", f"node_id={name},{self.conf}",
            "--health-port", "0", "--log-dir", str(log_dir), "--shutdown-timeout", "5",
            *self.flags, *flags, *self.worker,
        ]
        env = {"HEAL_NODE": name, "HEAL_BAD": "1" if bad else "0"}
        sup = await self.stack.enter_async_context(supervisor(args, env=env))
        node = HealNode(name, sup, log_dir, self.run_id)
        self.nodes.append(node)
        return node

    def worker_pids(self) -> set[int]:
        return set().union(*(node.worker_pids() for node in self.nodes))

    async def key(self, name: str) -> Any:
        url = self.endpoint if "://" in self.endpoint else f"http://{self.endpoint}"
        async with EtcdClient([url]) as client:
            kv = await client.get(f"/elastic-supervisor/{self.run_id}/{name}")
        return None if kv is None else json.loads(kv.value)


def worker_args(job_root: Path, *extra: str) -> list[str]:
    return [HEALING_WORKER, "--bad-gate", str(job_root / "bad-gate"),
            "--done", str(job_root / "done"), *extra]


@asynccontextmanager
async def healing_job(root: Path, endpoint: str, *, nnodes: str = "3:3",
                      flags: Sequence[str] = (), worker: Sequence[str] | None = None,
                      conf: str = f"last_call_timeout=0.5,lease_ttl={TTL}",
                      backend: str = "etcd") -> AsyncIterator[HealingJob]:
    """A job's nodes; on exit every daemon still running is SIGKILLed and every worker any
    of them started must be gone within 10 s."""
    made = HealingJob(AsyncExitStack(), root, endpoint, nnodes, flags,
                      worker if worker is not None else worker_args(root), conf, backend)
    try:
        async with made.stack:
            yield made
    finally:
        with anyio.CancelScope(shield=True):
            await wait_dead(sorted(made.worker_pids()), timeout=10)


async def exit_code(node: HealNode, timeout: float = 30.0) -> int:
    return await node.sup.wait(timeout=timeout)


async def group_without(bad: HealNode, others: list[HealNode]) -> None:
    """Until every node of ``others`` runs its worker in one round the bad node was never
    in (each ready line names its round's master port)."""
    bad_rounds = {str(e["master_port"]) for e in bad.events("group_started")}
    ports = []
    for node in others:
        while True:
            port = (await node.sup.out.expect(r"^ready \d n\d world 3 port (\d+)$",
                                              timeout=60))[1]
            if port not in bad_rounds:
                break
        ports.append(port)
    assert len(set(ports)) == 1, ports


PYTHON = sys.executable
