"""The embedded default backend: a fixed set of nodes, no server.

On one node it picks a fresh free master port for every attempt, so a restarted group
never reads the previous attempt's store. With several nodes (``--nnodes N --node-rank R
--master-addr A``) there is nothing to publish a port through, so ``--master-port`` is
used as given (default 29500, as torchrun). The node of rank 0 holds the master port
(``hold_port``) from its start, or from when it picks one, until the next pick or the end:
nothing else on the host takes it before the rank-0 worker's store binds it.
"""

from __future__ import annotations

import socket

import anyio
from anyio.abc import TaskStatus

from supervisor.core.nodehealth import Limits
from supervisor.core.peers import PeerCheck
from supervisor.rendezvous.base import (
    BarrierResult,
    Capabilities,
    NodeLedger,
    RendezvousResult,
    free_port,
    hold_port,
)
from supervisor.rendezvous.local_health import LocalNodeLedger

DEFAULT_MASTER_PORT = 29500


class StaticRendezvous:
    """A rendezvous that completes at once with a layout fixed by the flags."""

    backend = "static"
    # a fixed set of nodes, each on its own: nothing is agreed with the others
    capabilities = Capabilities(membership_can_change=False, coordinates_nodes=False,
                                job_status=False)

    def __init__(
        self,
        run_id: str,
        nnodes: int,
        node_rank: int,
        master_addr: str,
        master_port: int | None,
    ) -> None:
        self.run_id = run_id
        self.nnodes = nnodes
        self.node_rank = node_rank
        self.master_addr = master_addr
        self.master_port = master_port
        self._round = 0
        self._restarts = 0
        self._held: socket.socket | None = None  # the master port, while this node holds it

    def _port(self) -> int:
        if self.master_port:
            return self.master_port
        if self.nnodes == 1:
            self._release()  # the previous attempt's group has stopped
            self._held = hold_port()
            if self._held is not None:
                return int(self._held.getsockname()[1])
            return free_port(self.master_addr)
        return DEFAULT_MASTER_PORT

    def _release(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None

    def extra_pids(self) -> list[int]:
        return []

    def etcd_service(self) -> None:
        return None

    async def connect(self) -> None:
        if self.master_port and self.node_rank == 0:  # the given port, from the start
            self._held = hold_port(self.master_port)

    async def run(self, *, task_status: TaskStatus[None]) -> None:
        task_status.started()  # nothing to keep alive

    async def next_round(self, local_world_size: int) -> RendezvousResult:
        self._round += 1
        return RendezvousResult(
            round=self._round,
            group_rank=self.node_rank,
            group_world_size=self.nnodes,
            rank_offset=self.node_rank * local_world_size,
            world_size=self.nnodes * local_world_size,
            master_addr=self.master_addr,
            master_port=self._port(),
            members=tuple(f"node{i}" for i in range(self.nnodes)),
        )

    async def wait_membership_change(self, result: RendezvousResult) -> str:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def record_failure_restart(self, message: str) -> int:
        self._restarts += 1
        return self._restarts

    async def restart_count(self) -> int:
        return self._restarts

    async def exit_barrier(self, result: RendezvousResult, timeout: float) -> BarrierResult:
        return BarrierResult(ok=True)

    async def fail_job(self, message: str) -> None:
        return None

    async def leave(self, *, tell_peers: bool = True) -> None:
        return None

    async def aclose(self) -> None:
        self._release()

    def node_ledger(self, limits: Limits) -> NodeLedger:
        return LocalNodeLedger(limits)

    async def check_peers(self, result: RendezvousResult, within: float) -> PeerCheck:
        """Nothing to ask: the static backend knows no peer's health endpoint."""
        return PeerCheck()

    async def serve_until_job_ends(self) -> None:
        return None
