"""The etcd v3 rendezvous backend (DESIGN section 4), O(1) etcd work per agent per round.

Every agent follows only the job's control keys (``ctl/``, see ``keys``) by one
watch and writes only its own keys, each by one guarded txn: it joins a round, waits to be
admitted, publishes the master (group rank 0), opens a new round after its own failure,
marks itself done. One agent, the **leader** (whoever holds the lease-bound ``ctl/leader``
key; another takes over when its lease goes), also follows the per-node keys and makes
every job-wide decision: it closes a round (``max_nodes`` joined, ``last_call_timeout``
passed since ``min_nodes`` joined, or every live node of the previous round rejoined, so
restarts skip the last call), opens the next one when a member's key vanished or a node
waits and there is room, and closes the job when every member finished. So a round costs
each agent a constant number of requests and watch events whatever the job's size; the
leader sees one event per node. Group ranks follow node ids, stable across rounds.

etcd outages are ridden out (``outage_limit``; None: any length): nothing here gives up
while etcd is unreachable, a lease that expired across the outage is replaced and this
agent's keys restored, and the leader treats a member whose key vanished within one TTL of
etcd's return as not lost yet, so a member set that re-forms identically is no change.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from anyio.abc import TaskStatus

from supervisor.core.jobstep import ReportSource
from supervisor.core.nodehealth import Limits
from supervisor.core.peers import PeerCheck
from supervisor.rendezvous.base import (
    BarrierResult,
    Capabilities,
    EtcdService,
    NodeLedger,
    RendezvousResult,
)
from supervisor.rendezvous.etcd import barrier
from supervisor.rendezvous.etcd.agent import Agent, EventHook, etcd_errors
from supervisor.rendezvous.etcd.config import EtcdRendezvousConfig
from supervisor.rendezvous.etcd.keys import Policy
from supervisor.rendezvous.etcd.leader import Leader, campaign
from supervisor.rendezvous.etcd.leave_notice import LeaveNotices
from supervisor.rendezvous.etcd.node_records import EtcdNodeLedger
from supervisor.rendezvous.etcd.outage import Outages
from supervisor.rendezvous.etcd.peers import check_peers
from supervisor.rendezvous.etcd.rounds import Rounds
from supervisor.rendezvous.etcd.waitreport import WaitProgress
from supervisor.rendezvous.etcd.wire.client import KeyValue, Reachability
from supervisor.rendezvous.etcd.wire.watch import open_prefix_view

logger = logging.getLogger("supervisor.rendezvous.etcd")  # the backend's lines, whichever module


class EtcdRendezvous:
    """The ``Rendezvous`` backend over etcd v3. Start ``run`` in a task group first.

    A facade: this agent's state and writes are ``agent``'s, the rounds ``rounds``', the
    exit barrier and restart count ``barrier``'s, outages and peers cut off ``outage``'s,
    the job-wide decisions ``leader``'s. ``on_event`` (for example ``EventLog.emit``)
    hears ``etcd_unreachable``, ``etcd_reachable`` and ``etcd_lease_replaced``;
    ``reachability`` and ``stats`` are the client's live counters (outages, requests,
    conflicts, watch events)."""

    backend = "etcd"
    capabilities = Capabilities(membership_can_change=True, coordinates_nodes=True,
                                job_status=True)

    def __init__(self, config: EtcdRendezvousConfig, *, on_event: EventHook | None = None
                 ) -> None:
        self.config = config
        self.run_id = config.run_id
        self.node_id = config.node_id
        self._agent = agent = Agent(
            config, on_event=on_event,
            on_reachability=lambda up, r: self._outages.on_reachability(up, r),
            on_lease_expired=lambda across: self._outages.lease_replaced(across))
        self._outages = Outages(agent)
        self._rounds = Rounds(agent, self._outages.cutoff)
        policy = Policy(config.min_nodes, config.max_nodes, config.last_call_timeout)
        self._leader = Leader(agent.client, agent.keys, policy, agent.lease, config.node_id)

    @property
    def on_event(self) -> EventHook | None:
        return self._agent.on_event

    @on_event.setter
    def on_event(self, hook: EventHook | None) -> None:
        self._agent.on_event = hook

    @property
    def notices(self) -> LeaveNotices:
        """Leave notices peers send this node directly (``leave_notice``)."""
        return self._outages.notices

    @property
    def lease_id(self) -> int:
        """This agent's etcd lease (0 before ``connect``)."""
        return self._agent.lease.id

    @property
    def stats(self) -> dict[str, int]:
        """Requests, txn conflicts, retries and watch events of this agent's client."""
        return self._agent.client.stats.as_dict()

    @property
    def reachability(self) -> Reachability:
        return self._agent.client.reachability

    @property
    def waiting(self) -> WaitProgress | None:
        """For /status: what ``next_round`` waits for."""
        return self._agent.waiting

    @property
    def joined_at(self) -> float:
        """Monotonic: this agent's last join key was written."""
        return self._agent.joined_at

    @property
    def snapshot_report(self) -> ReportSource | None:
        """What this node's snapshots hold, told in its join value (None: none)."""
        return self._agent.snapshot_report

    @snapshot_report.setter
    def snapshot_report(self, source: ReportSource | None) -> None:
        self._agent.snapshot_report = source

    async def put_control(self, name: str, value: str) -> None:
        await self._agent.put_control(name, value)

    def control_changes(self, name: str) -> AsyncIterator[KeyValue | None]:
        return self._agent.control_changes(name)

    @property
    def waited_at(self) -> float:
        """Monotonic: this agent's last wait key was written."""
        return self._agent.waited_at

    @property
    def spare(self) -> bool:
        """This node waits as a spare (beyond max_nodes, the round is full)."""
        return self._agent.spare

    def outage_status(self) -> dict[str, Any]:
        """For ``/status``: whether etcd answers, and the outages so far (``outage``)."""
        return self._outages.status()

    # lifecycle

    def extra_pids(self) -> list[int]:
        return []

    def etcd_service(self) -> EtcdService:
        return self

    async def connect(self) -> None:
        """Take this node's lease (once), waiting up to ``join_timeout`` for etcd to
        answer (``outage``); raises ``RendezvousError`` if it does not, or refuses."""
        await self._outages.connect()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Connect (if not yet), follow the control keys, report ready, then keep the lease
        alive and campaign for leadership until ``aclose()`` or cancellation; leaves and
        releases everything on the way out."""
        agent = self._agent
        agent.run_active = True
        try:
            await self.connect()
            with etcd_errors("reading the job's control keys"):
                # bounded like connect(): the supervisor is still starting
                async with open_prefix_view(agent.client, agent.keys.ctl,
                                            retry_window=self.config.lease_ttl,
                                            on_live=self._outages.watch_live) as view:
                    agent.ctl = view
                    agent.running = True
                    agent.ready.set()
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(campaign, agent, self._leader)
                        tg.start_soon(self._outages.cutoff.run)
                        tg.start_soon(self.notices.run)
                        task_status.started()
                        await agent.lease.keep_alive()
                        await agent.closed.wait()
                        tg.cancel_scope.cancel()
        finally:
            agent.run_active = False
            agent.run_exited.set()
            with anyio.CancelScope(shield=True):
                await self.aclose()

    async def leave(self, *, tell_peers: bool = True) -> None:
        """Revoke the lease: this node's keys vanish, the others re-form; the job goes on.
        With ``tell_peers`` (a graceful leave; not when the run is simply over), a node
        that runs a round also tells its peers directly (``core.leave_notice``), for when
        etcd cannot commit the revoke at once."""
        agent = self._agent
        if not agent.left:
            agent.left = True
            if not agent.lease.id:
                return  # never joined (etcd was unreachable): nothing to leave
            round_ = self._outages.cutoff.round
            async with anyio.create_task_group() as tg:
                if tell_peers and round_ >= 0:
                    agent.left_round = round_
                    agent.emit("rendezvous_left", round=round_)  # /status says so first
                    tg.start_soon(self.notices.tell, round_)
                with anyio.move_on_after(self.config.request_timeout):
                    await agent.lease.revoke()
            logger.info("left %s %s as %s", self.config.label, self.run_id, self.node_id)

    async def aclose(self) -> None:
        """Leave (if not done yet) and close connections. Idempotent."""
        agent = self._agent
        if agent.closed.is_set():
            return
        await self.leave(tell_peers=False)
        agent.closed.set()
        if agent.run_active:  # let run() close its watches before the session goes
            with anyio.move_on_after(self.config.request_timeout):
                await agent.run_exited.wait()
        await agent.client.aclose()

    # rounds (``rounds``)

    async def next_round(self, local_world_size: int) -> RendezvousResult:
        return await self._rounds.next_round(local_world_size)

    async def wait_membership_change(self, result: RendezvousResult) -> str:
        return await self._rounds.wait_membership_change(result)

    # job-wide (``barrier``)

    async def exit_barrier(self, result: RendezvousResult, timeout: float) -> BarrierResult:
        return await barrier.exit_barrier(self._agent, result, timeout)

    async def record_failure_restart(self, message: str) -> int:
        return await barrier.record_failure_restart(self._agent, message)

    async def restart_count(self) -> int:
        return await barrier.restart_count(self._agent)

    async def fail_job(self, message: str) -> None:
        await barrier.fail_job(self._agent, message)

    async def wait_job_closed(self) -> None:
        """Until the job is closed for everyone (a quarantined c10d host serves until then)."""
        await barrier.wait_job_closed(self._agent)

    # node health and peers

    def node_ledger(self, limits: Limits) -> NodeLedger:
        """This node's health facts in the job's etcd (``node_records``)."""
        agent = self._agent
        return EtcdNodeLedger(agent.client, agent.keys.prefix, self.config.health_id,
                              self.node_id, limits, spare=lambda: agent.spare)

    async def check_peers(self, result: RendezvousResult, within: float) -> PeerCheck:
        """The other members' health endpoints and leases (``peers``)."""
        agent = self._agent
        return await check_peers(agent.client, agent.keys, self._outages.cutoff, self.run_id,
                                 self.node_id, result, within)

    async def serve_until_job_ends(self) -> None:
        """Nothing to serve: an external etcd outlives this node."""


@asynccontextmanager
async def open_etcd_rendezvous(config: EtcdRendezvousConfig) -> AsyncIterator[EtcdRendezvous]:
    """An ``EtcdRendezvous`` whose lease is kept alive for the block; closed on exit."""
    rdzv = EtcdRendezvous(config)
    try:
        await rdzv.connect()  # here, so a bad endpoint raises plainly, not in a group
    except BaseException:
        with anyio.CancelScope(shield=True):
            await rdzv.aclose()
        raise
    body_error: BaseException | None = None
    async with anyio.create_task_group() as tg:
        await tg.start(rdzv.run)
        try:
            yield rdzv
        except BaseException as exc:  # re-raised below, not wrapped in an ExceptionGroup
            body_error = exc
        finally:
            with anyio.CancelScope(shield=True):
                await rdzv.aclose()
    if body_error is not None:
        raise body_error
