"""One agent's part in the rounds (DESIGN section 4): join the open round, wait to be
admitted, publish the master (group rank 0), open a new round after its own failure, and
tell when the round it runs is outdated. The leader closes rounds (``leader``); every
decision here reads the control view and writes one guarded txn (``agent``).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict

import anyio
import msgspec

from supervisor.rendezvous.base import (
    RendezvousClosed,
    RendezvousError,
    RendezvousResult,
    free_port,
)
from supervisor.rendezvous.etcd.agent import Agent, etcd_errors
from supervisor.rendezvous.etcd.cutoff import CutoffCheck
from supervisor.rendezvous.etcd.keys import Member, State, advance_txn, round_guard
from supervisor.rendezvous.etcd.sameid import ended_line, meet, shape_value
from supervisor.rendezvous.etcd.waitreport import WaitClock, WaitProgress
from supervisor.rendezvous.etcd.wire.client import EtcdError, compare, put_op
from supervisor.rendezvous.etcd.wire.jobstep import join_fields

logger = logging.getLogger("supervisor.rendezvous.etcd")  # the backend's lines

PEER_LEARNING_BOUND = 1.0  # seconds a completed round may spend reading its peers' URLs
_Done = tuple[list[Member], tuple[str, int]]  # a finished round: members, (addr, port)


class Rounds:
    """``next_round`` and ``wait_membership_change`` of one agent."""

    def __init__(self, agent: Agent, cutoff: CutoffCheck) -> None:
        self._agent = agent
        self._cutoff = cutoff
        self._clock: WaitClock | None = None  # the round being waited for, if any

    async def next_round(self, local_world_size: int) -> RendezvousResult:
        """Join the next round and wait until it completes: at most ``join_timeout`` while
        etcd answers, plus any outage (bounded by ``outage_limit``)."""
        agent, config = self._agent, self._agent.config
        await agent.usable()
        agent.evicted, agent.cut_off_reason = False, None
        # a round this node opens itself says why (the others' goodput causes read it)
        agent.advance_reason = agent.told_left[1] if agent.told_left else ""
        agent.told_left = None
        self._cutoff.round_ended()
        started = time.monotonic()
        result: RendezvousResult | None = None
        self._clock = WaitClock(started, time.time(), config.wait_report_every)
        agent.waiting = WaitProgress("this node's next round", self._clock.started_wall, 0.0,
                                     needed=config.min_nodes, max_nodes=config.max_nodes)
        try:
            async with agent.closing_on_bad_value():
                with etcd_errors("joining a round"), agent.join_deadline():
                    if agent.last_round < 0 and agent.joined < 0:
                        await self._arrive(local_world_size)
                    result = await self._rendezvous(local_world_size, started)
        finally:
            self._clock, agent.waiting = None, None
        if result is None:
            raise RendezvousError(f"etcd rendezvous {agent.run_id} timed out after "
                                  f"{config.join_timeout:g}s: {await self._describe()}")
        with anyio.move_on_after(PEER_LEARNING_BOUND):  # a few reads; never delays a round long
            await self._cutoff.learn_peers()
        logger.info("%s round %d complete in %.3fs: group rank %d of %d, "
                    "master %s:%d", config.label, result.round, result.duration,
                    result.group_rank, result.group_world_size, result.master_addr,
                    result.master_port)
        return result

    async def _arrive(self, lws: int) -> None:
        """Before this node first joins: has it met another job under the same run id?
        (``supervisor.rendezvous.etcd.sameid``) Records the job's shape if nobody did yet."""
        agent, config = self._agent, self._agent.config
        state, key = agent.state(), agent.keys.ctl + "shape"
        shape = msgspec.to_builtins(state.shape) if state.shape else None  # bad: ignored
        members = state.members(state.round)
        closed = msgspec.to_builtins(state.closed) if state.closed else None
        verdict = meet(agent.run_id, closed=closed, shape=shape,
                       running_sizes=[m.local_world_size for m in members] if members else None,
                       min_nodes=config.min_nodes, max_nodes=config.max_nodes,
                       nproc_per_node=lws)
        if verdict is not None and verdict.fatal:
            raise RendezvousClosed(f"etcd rendezvous: {verdict.line}")
        if verdict is not None:
            logger.warning("%s: %s", config.label, verdict.line)
        if state.kv(key) is None:
            value = shape_value(config.min_nodes, config.max_nodes, lws)
            await agent.write([compare(key, "VERSION", "=", 0)], [put_op(key, value)])

    async def _describe(self) -> str:
        """Where the round stands, for a timeout message (one count request, best effort)."""
        agent, config = self._agent, self._agent.config
        n = agent.state().round
        if agent.state().members(n) is not None:
            return agent.progress
        count = await self._joined_count(n)
        if count is None:
            return agent.progress
        return (f"round {n}: {count} node(s) joined, need {config.min_nodes} "
                f"(max {config.max_nodes})")

    async def _joined_count(self, n: int) -> int | None:
        """How many nodes joined round n (one count request, best effort: None)."""
        client = self._agent.client
        try:
            with anyio.move_on_after(client.timeout):
                return await client.count(self._agent.keys.node(n, "join"), prefix=True)
        except EtcdError:
            pass
        return None

    async def _report_wait(self) -> None:
        """Every 30 s while next_round waits: one line, ``/status`` and an event; at the
        first wait ``/status`` and the event only (most rounds complete in a moment)."""
        agent, config = self._agent, self._agent.config
        clock, now = self._clock, time.monotonic()
        if clock is None or not (clock.due(now) or not clock.announced):
            return
        first, clock.announced = not clock.announced, True
        clock.reported(now)
        n = agent.state().round
        running = agent.state().members(n) is not None
        what = (f"admission ({agent.progress})" if running and agent.waiting_in == n
                else f"nodes to join round {n}")
        agent.waiting = WaitProgress(
            what, clock.started_wall, clock.waited(now),
            joined=None if running else await self._joined_count(n),
            needed=config.min_nodes, max_nodes=config.max_nodes)
        logger.log(logging.DEBUG if first else logging.INFO, "%s %s: %s", config.label,
                   agent.run_id, agent.waiting.line())
        agent.emit("rendezvous_waiting", **agent.waiting.as_status())

    async def _rendezvous(self, lws: int, started: float) -> RendezvousResult:
        agent = self._agent
        assert agent.ctl is not None
        while True:
            seen, state = agent.ctl.version, agent.state()
            if state.closed is not None and agent.last_round < 0:
                ended = ended_line(agent.run_id, msgspec.to_builtins(state.closed))
                raise RendezvousClosed(f"etcd rendezvous: {ended}")
            if state.closed is not None:
                raise RendezvousClosed(f"job {agent.run_id} is closed: {state.closed.reason}",
                                       succeeded=bool(state.closed.ok))
            done = await self._step(state, lws)
            if isinstance(done, tuple):
                return self._result(state.round, *done, started)
            if not done:
                await self._report_wait()
                await agent.wait(seen, self._clock.next_due if self._clock else math.inf)

    async def _step(self, state: State, lws: int) -> _Done | bool:
        """One decision: a finished round, or whether something was written (decide again
        now) rather than waiting for a change."""
        agent = self._agent
        n = state.round
        members = state.members(n)
        if members is None:
            if agent.joined == n:
                agent.progress = f"round {n}: joined; waiting for the leader to close it"
                return False
            return await self._join(state, n, lws) or True
        if agent.node_id in {m.node for m in members} and agent.joined == n:
            if n > agent.last_round:
                return await self._finishing(state, n, members)
            # restarting from a round it already ran
            await self._advance(state, n, agent.advance_reason)
            return True
        return await self._waiting_room(state, n, members)

    async def _join(self, state: State, n: int, lws: int) -> bool:
        agent = self._agent
        agent.set_spare(False)
        me = Member(agent.node_id, agent.config.local_addr, lws)
        same_round = round_guard(state)
        guard = [*same_round, compare(agent.keys.result(n), "VERSION", "=", 0)]
        # restored after an outage even once the round is complete: it is still a member
        ok = await agent.put_held(agent.keys.node(n, "join", agent.node_id),
                                  json.dumps({**asdict(me), **join_fields(agent.snapshot_report)}),
                                  guard, seen_in_view=False,
                                  restore_guard=same_round)
        if ok:
            agent.joined, agent.joined_at = n, time.monotonic()
        return ok

    async def _finishing(self, state: State, n: int, members: list[Member]) -> _Done | bool:
        agent = self._agent
        master = state.master(n)
        if master is not None:
            return members, master
        if members[0].node != agent.node_id:
            agent.progress = f"round {n}: waiting for group rank 0 to publish the master port"
            return False
        addr = agent.config.local_addr
        await agent.write(
            [*round_guard(state), compare(agent.keys.master(n), "VERSION", "=", 0)],
            [put_op(agent.keys.master(n), json.dumps({"addr": addr, "port": free_port(addr)}))])
        return True

    async def _waiting_room(self, state: State, n: int, members: list[Member]) -> bool:
        """This node is not in round n: ask to be admitted (the leader opens a new round
        when there is room, or when round n lost a member)."""
        agent = self._agent
        if agent.waiting_in != n:
            ok = await agent.put_held(agent.keys.node(n, "wait", agent.node_id), "{}",
                                      round_guard(state), seen_in_view=False)
            if ok:
                agent.waiting_in, agent.waited_at = n, time.monotonic()
            return True
        agent.progress = (f"waiting to be admitted: round {n} runs with {len(members)} "
                          f"node(s) (max {agent.config.max_nodes})")
        if len(members) >= agent.config.max_nodes:
            agent.set_spare(True, round=n)
        return False

    async def _advance(self, state: State, n: int, reason: str) -> bool:
        """Open round n+1 (if nobody did yet) and forget round n-1."""
        ok = await self._agent.write(*advance_txn(state, reason, self._agent.node_id))
        if ok:
            logger.info("%s: opened round %d%s", self._agent.config.label, n + 1,
                        f" ({reason})" if reason else "")
        return ok

    def _result(self, n: int, members: list[Member], master: tuple[str, int],
                started: float) -> RendezvousResult:
        agent = self._agent
        ids = [m.node for m in members]
        rank = ids.index(agent.node_id)
        sizes = [m.local_world_size for m in members]
        agent.last_round, agent.advance_reason = n, ""
        spare, agent.was_spare = agent.was_spare, False
        self._cutoff.round_started(n, ids)
        return RendezvousResult(
            round=n, group_rank=rank, group_world_size=len(members),
            rank_offset=sum(sizes[:rank]), world_size=sum(sizes),
            master_addr=master[0], master_port=master[1], members=tuple(ids),
            duration=time.monotonic() - started, spare=spare,
            snapshot=agent.state().job_step(n),
        )

    # while the round runs

    async def wait_membership_change(self, result: RendezvousResult) -> str:
        """Return why round ``result`` is outdated: the leader (or a restarting node) opened
        a new round, or the job closed. Raises ``RendezvousError`` if this node's own lease
        was lost while etcd was reachable (the others saw it leave)."""
        agent = self._agent
        await agent.usable()
        assert agent.ctl is not None
        async with agent.closing_on_bad_value():
            with etcd_errors("watching membership"):
                while True:
                    seen = agent.ctl.version
                    reason = self._membership_change(agent.state(), result)
                    if reason is not None:
                        logger.info("%s round %d outdated: %s", agent.config.label,
                                    result.round, reason)
                        return reason
                    await agent.wait(seen)

    def _membership_change(self, state: State, result: RendezvousResult) -> str | None:
        agent = self._agent
        if state.closed is not None:
            return f"job closed: {state.closed.reason}"
        if state.round > result.round:
            return state.round_reason or f"round {state.round} was opened by another node"
        if agent.evicted:
            why = agent.evicted_reason or "the others saw it leave"
            raise RendezvousError(f"this node's etcd lease was lost (now {agent.lease.id:x}): "
                                  f"{why}")
        if agent.cut_off_reason is not None:
            return f"cut off from etcd: {agent.cut_off_reason}"
        if agent.told_left is not None and agent.told_left[0] == result.round:
            return agent.told_left[1]
        return None
