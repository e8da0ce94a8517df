"""Nodes of one job: real supervisor daemons, one process per node, against a real etcd.

Every node is ``python -m supervisor run --rdzv-backend etcd`` with its own log dir and
health port; its fake workers print one ``env NAME=VALUE ...`` line with the rendezvous
variables, and the tests synchronise on those lines and on each node's ``events.jsonl``
(monotonic ``mono`` timestamps compare across processes: CLOCK_MONOTONIC is system-wide).
"""

from __future__ import annotations

import json
import signal
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio

from supervisor.rendezvous.etcd.wire.client import EtcdClient
from tests.support.daemon import Supervised, supervisor
from tests.support.eventlog import read_events
from tests.support.paths import FAKE_WORKER
from tests.support.processes import wait_dead

LOCAL = 2  # workers per node
TTL = 2  # lease TTL (s) of the membership tests
FAST = f"last_call_timeout=0.5,lease_ttl={TTL}"
SHOWN = ("RANK,LOCAL_RANK,GROUP_RANK,WORLD_SIZE,GROUP_WORLD_SIZE,MASTER_ADDR,MASTER_PORT,"
         "TORCHELASTIC_RESTART_COUNT")
# DESIGN/issue 7: running agents restart into the bigger round within 1 s of the join.
# Measured here (2 cores, 4 daemons + 8 workers + etcd): 0.05-0.2 s, 0.35 s under 2 busy loops.
SCALE_UP_BOUND = 1.0
# etcd's lessor revokes expired leases on a 500 ms tick (lessor.go, runLoop): a lease
# vanishes up to this long after its TTL ran out
ETCD_LEASE_TICK = 0.5

Env = dict[str, str]




class Node:
    """One supervisor daemon of the job."""

    def __init__(self, sup: Supervised, log_dir: Path, run_id: str, spawned: float) -> None:
        self.sup = sup
        self.log_dir = log_dir
        self.run_id = run_id
        self.spawned = spawned  # monotonic, just before the process was started

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return read_events(self.log_dir / self.run_id / "events.jsonl", kind)

    def mono(self, kind: str, after: float = 0.0) -> float:
        """Monotonic time of this node's first ``kind`` event after ``after``."""
        times = [float(e["mono"]) for e in self.events(kind) if float(e["mono"]) > after]
        assert times, f"no {kind} event after {after}: {self.events()}"
        return times[0]

    def worker_pids(self) -> set[int]:
        return {int(pid) for e in self.events("group_started") for pid in e["pids"].values()}

    def current_pids(self) -> set[int]:
        started = self.events("group_started")
        return {int(pid) for pid in started[-1]["pids"].values()} if started else set()

    async def group(self, world_size: int, restart: int | None = None,
                    timeout: float = 20.0) -> dict[int, Env]:
        """The env of this node's workers in its next group of ``world_size`` workers
        (and restart count), by local rank; older groups' lines are skipped."""
        by_round: dict[tuple[str, str], dict[int, Env]] = {}
        with anyio.fail_after(timeout):
            while True:
                match = await self.sup.out.expect(r"^env (.*)$", timeout=timeout)
                env = dict(item.split("=", 1) for item in match[1].split())
                if int(env["WORLD_SIZE"]) != world_size:
                    continue
                if restart is not None and int(env["TORCHELASTIC_RESTART_COUNT"]) != restart:
                    continue
                group = by_round.setdefault((env["MASTER_PORT"], env["GROUP_RANK"]), {})
                group[int(env["LOCAL_RANK"])] = env
                if len(group) == LOCAL:
                    await self._logged(env["MASTER_PORT"], env["TORCHELASTIC_RESTART_COUNT"])
                    return group

    async def _logged(self, master_port: str, restart: str) -> None:
        """Wait for the ``group_started`` event of the group whose lines were read: its
        workers print as they start, and the daemon logs the event once every rank has
        started, a little later; counting events at once could miss it (and then count it
        as a restart later). The daemon logs the launch on stderr after it has written the
        event, so each new stderr line is the moment to look again; the caller's timeout
        bounds the wait."""
        while not any(str(e["master_port"]) == master_port
                      and str(e["restart_count"]) == restart
                      for e in self.events("group_started")):
            await self.sup.err.next_line()


class Cluster:
    """Starts nodes of one job; see ``cluster``."""

    def __init__(self, stack: AsyncExitStack, root: Path, endpoint: str, nnodes: str,
                 conf: str, flags: Sequence[str], worker: Sequence[str]) -> None:
        self.stack = stack
        self.root = root
        self.endpoint = endpoint
        self.nnodes = nnodes
        self.conf = conf
        self.flags = list(flags)
        self.worker = list(worker)
        self.run_id = f"mn-{uuid.uuid4().hex[:10]}"
        self.nodes: list[Node] = []

    async def start(self, count: int = 1) -> list[Node]:
        started = []
        for _ in range(count):
            log_dir = self.root / f"node{len(self.nodes)}"
            args = [
                "--rdzv-backend", "etcd", "--rdzv-endpoint", self.endpoint,
                "--rdzv-id", self.run_id, "--nnodes", self.nnodes,
                "--nproc-per-node", str(LOCAL), "--rdzv-conf", self.conf,
                "--health-port", "0", "--log-dir", str(log_dir), "--shutdown-timeout", "5",
                *self.flags, FAKE_WORKER, "--print-env", SHOWN, *self.worker,
            ]
            spawned = time.monotonic()
            sup = await self.stack.enter_async_context(supervisor(args))
            node = Node(sup, log_dir, self.run_id, spawned)
            self.nodes.append(node)
            started.append(node)
        return started

    async def groups(self, nodes: Sequence[Node], world_size: int,
                     restart: int | None = None, timeout: float = 20.0) -> list[dict[int, Env]]:
        """Every node's next group of ``world_size`` workers, waited for concurrently."""
        found: list[dict[int, Env]] = [{} for _ in nodes]

        async def one(i: int) -> None:
            found[i] = await nodes[i].group(world_size, restart, timeout)

        async with anyio.create_task_group() as tg:
            for i in range(len(nodes)):
                tg.start_soon(one, i)
        return found

    def worker_pids(self) -> set[int]:
        return set().union(*(node.worker_pids() for node in self.nodes))


@asynccontextmanager
async def cluster(tmp_path: Path, endpoint: str, *, nnodes: str, conf: str = FAST,
                  flags: Sequence[str] = (), worker: Sequence[str] = ("--hang",),
                  ) -> AsyncIterator[Cluster]:
    """A job's nodes; on exit every daemon still running is SIGKILLed and every worker any
    of them started must be gone (death signal and guardian) within 10 s."""
    made = Cluster(AsyncExitStack(), tmp_path, endpoint, nnodes, conf, flags, worker)
    try:
        async with made.stack:
            yield made
    finally:
        with anyio.CancelScope(shield=True):
            await wait_dead(sorted(made.worker_pids()), timeout=10)


def assert_one_group(groups: Sequence[dict[int, Env]], nodes: int) -> None:
    """The nodes' groups form one job: unique ranks and group ranks, one master."""
    envs = [env for group in groups for env in group.values()]
    world = nodes * LOCAL
    assert sorted(int(e["RANK"]) for e in envs) == list(range(world))
    assert sorted(int(g[0]["GROUP_RANK"]) for g in groups) == list(range(nodes))
    for group in groups:
        assert {e["GROUP_RANK"] for e in group.values()} == {group[0]["GROUP_RANK"]}
    for e in envs:
        assert int(e["RANK"]) == int(e["GROUP_RANK"]) * LOCAL + int(e["LOCAL_RANK"])
        assert int(e["WORLD_SIZE"]) == world and int(e["GROUP_WORLD_SIZE"]) == nodes
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1


def node_with_group_rank(nodes: Sequence[Node], groups: Sequence[dict[int, Env]],
                         rank: int) -> Node:
    return next(n for n, g in zip(nodes, groups, strict=True) if g[0]["GROUP_RANK"] == str(rank))


async def read_key(endpoint: str, run_id: str, name: str) -> Any:
    async with EtcdClient(endpoint.split(",")) as client:
        kv = await client.get(f"/elastic-supervisor/{run_id}/{name}")
    return None if kv is None else json.loads(kv.value)


async def stop_all(nodes: Sequence[Node]) -> None:
    """SIGTERM every node; each must leave cleanly with 143."""
    for node in nodes:
        node.sup.signal(signal.SIGTERM)
    for node in nodes:
        assert await node.sup.wait(timeout=15) == 128 + signal.SIGTERM


def restarts_since(nodes: Sequence[Node], counts: Sequence[int]) -> list[int]:
    return [len(n.events("group_started")) - c for n, c in zip(nodes, counts, strict=True)]


async def exit_code_within(node: Node, seconds: float) -> int | None:
    """The node's exit code, or None if it still runs after ``seconds``."""
    with anyio.move_on_after(seconds):
        return await node.sup.wait(timeout=seconds + 5)
    return None


async def assert_still_coordinated(job: Cluster, stay: Node, leave: Node) -> None:
    """The rendezvous still works after an outage: one node leaves, the other re-forms alone."""
    leave.sup.signal(signal.SIGTERM)
    assert await leave.sup.wait(timeout=15) == 128 + signal.SIGTERM
    assert_one_group([await stay.group(LOCAL, timeout=10)], 1)
    await stop_all([stay])
