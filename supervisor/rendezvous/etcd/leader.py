"""The etcd rendezvous leader: while this agent holds ``ctl/leader``, it follows every key
of the job and carries out ``keys.decide`` (close a round, open the next one, close
the job). Every other agent only follows ``ctl/``; see ``backend`` for the protocol."""

from __future__ import annotations

import json
import logging
import math
import time

import anyio

from supervisor.rendezvous.base import RendezvousError
from supervisor.rendezvous.etcd.agent import Agent
from supervisor.rendezvous.etcd.keys import (
    Advance,
    Close,
    Keys,
    Policy,
    State,
    Succeed,
    Txn,
    Wait,
    advance_txn,
    close_job_txn,
    close_round_txn,
    decide,
)
from supervisor.rendezvous.etcd.lease import LeaseKeeper
from supervisor.rendezvous.etcd.wire.client import EtcdClient, EtcdError, compare
from supervisor.rendezvous.etcd.wire.watch import PrefixView, open_prefix_view

logger = logging.getLogger(__name__)
_backend_logger = logging.getLogger("supervisor.rendezvous.etcd")  # campaign's lines


class Leader:
    """The job-wide decisions of one agent, for as long as its lease holds the leader key."""

    def __init__(self, client: EtcdClient, keys: Keys, policy: Policy, lease: LeaseKeeper,
                 node_id: str) -> None:
        self._client = client
        self._keys = keys
        self._policy = policy
        self._lease = lease
        self._node_id = node_id

    async def lead(self) -> None:
        """Follow every key of the job and decide; return once the leader key is not
        this agent's any more."""
        logger.info("etcd rendezvous: %s leads", self._node_id)
        min_since: tuple[int, float] | None = None
        async with open_prefix_view(self._client, self._keys.prefix) as view:
            while True:
                seen, state = view.version, State(self._keys, view.kvs)
                leader = state.leader
                if leader is None or leader.lease != self._lease.id:
                    logger.info("etcd rendezvous: %s no longer leads", self._node_id)
                    return
                n, now = state.round, time.monotonic()
                if len(state.nodes(n, "join")) < self._policy.min_nodes:
                    min_since = None
                elif min_since is None or min_since[0] != n:
                    min_since = (n, now)
                decision = decide(state, self._policy, now,
                                  min_since=min_since[1] if min_since else None,
                                  grace_until=self.grace_until())
                if isinstance(decision, Wait):
                    with anyio.move_on_after(decision.until - time.monotonic()):
                        await view.wait_changed(seen)
                    continue
                await self._carry_out(view, state, decision)

    def grace_until(self) -> float:
        """A member key that vanished is not lost until one TTL after etcd came back: a
        cluster frozen longer than the TTL expires every lease when it wakes, and each
        agent needs a moment to put its keys back."""
        r = self._client.reachability
        if r.unreachable_since is not None:
            return math.inf
        return r.recovered_at + self._lease.ttl if r.recovered_at is not None else 0.0

    async def _carry_out(self, view: PrefixView, state: State,
                         decision: Close | Advance | Succeed) -> None:
        txn: Txn
        if isinstance(decision, Succeed):
            txn = close_job_txn(self._keys, ok=True, reason="job succeeded", node=self._node_id)
            what = "job closed: every member finished"
        elif isinstance(decision, Advance):
            txn = advance_txn(state, decision.reason, self._node_id)
            what = f"opened round {decision.n + 1}: {decision.reason}"
        else:
            txn = close_round_txn(state, decision, view.revision)
            what = f"round {decision.n} closed with {len(decision.chosen)} node(s)"
        result = await self._client.txn(*txn)
        if result.succeeded:
            logger.info("etcd rendezvous: %s", what)
            with anyio.move_on_after(self._client.timeout):
                await view.wait_revision(result.revision)  # so it does not decide twice
        else:
            await view.refresh()


async def campaign(agent: Agent, leader: Leader) -> None:
    """Hold the leader key when nobody does, and lead while holding it."""
    assert agent.ctl is not None
    delay = 0.05
    while not agent.lease.given_up.is_set() and not agent.left:  # left: no lease
        seen, holder = agent.ctl.version, agent.state().leader
        try:
            if holder is None:
                await agent.put_held(agent.keys.leader, json.dumps({"node": agent.node_id}),
                                     [compare(agent.keys.leader, "VERSION", "=", 0)],
                                     seen_in_view=True)
                continue
            if holder.lease == agent.lease.id:
                await leader.lead()
                continue
            await agent.ctl.wait_changed(seen)
            delay = 0.05
        except (EtcdError, RendezvousError) as exc:
            if agent.lease.given_up.is_set() or agent.closed.is_set():
                return
            _backend_logger.warning("%s leader duty failed, retrying: %s", agent.config.label,
                                    exc)
            await anyio.sleep(delay)
            delay = min(delay * 2, 2.0)
