"""etcd outages as one agent lives them: taking the first lease while etcd does not
answer yet, pausing ``join_timeout`` while it is unreachable, restoring this agent's keys
under a lease that expired across an outage, the cut-off rule (``cutoff``,
``core.partition``), the leave notices peers send directly (``leave_notice``) and
/status's outage view.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio

from supervisor.core.partition import standing_since
from supervisor.rendezvous.etcd.agent import Agent, etcd_errors
from supervisor.rendezvous.etcd.cutoff import CutoffCheck
from supervisor.rendezvous.etcd.leave_notice import LeaveNotices
from supervisor.rendezvous.etcd.waitreport import WaitClock, WaitProgress, unresolved
from supervisor.rendezvous.etcd.wire.client import EtcdError, EtcdUnavailable, Reachability, put_op

logger = logging.getLogger("supervisor.rendezvous.etcd")  # the backend's lines


class Outages:
    """What one agent does while etcd does not answer, and about peers cut off from it."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        config = agent.config
        self.cutoff = CutoffCheck(agent.client, config.run_id, config.node_id,
                                  ttl=config.lease_ttl,
                                  last_refresh_sent=self._standing_since,
                                  on_cut_off=self._cut_off)
        self.notices = LeaveNotices(self.cutoff, config.run_id, config.node_id,
                                    on_peer_left=self._peer_left,
                                    etcd_answers=self._answers_within)
        self._connecting: WaitClock | None = None  # connect() waiting for etcd to answer

    def status(self) -> dict[str, Any]:
        """For ``/status``: whether etcd answers (to requests and to this node's watch:
        never "reachable" while the watch is dead), and the outages so far."""
        agent = self._agent
        ctl, r = agent.ctl, agent.client.reachability
        now = time.monotonic()
        watch_live = ctl is not None and ctl.watch_live
        reachable = r.unreachable_since is None and watch_live
        return {"reachable": reachable,
                # since when etcd answers again after an outage: the peers' cut-off rule
                "recovered_for": (round(now - r.recovered_at, 3)
                                  if reachable and r.recovered_at is not None else None),
                "requests_answered": r.unreachable_since is None,
                "watch": {"live": watch_live,
                          "endpoint": ctl.watch_endpoint if ctl else None,
                          "endpoints": list(ctl.watch_endpoints) if ctl else [],
                          "resyncs": ctl.resyncs if ctl else 0},
                "cut_off": agent.cut_off_reason,
                "left_round": agent.left_round,
                "unreachable_for": round(r.outage_age(now), 3),
                "outages": r.outages, "last_outage": round(r.last_outage, 3),
                "total_outage": round(r.total_outage, 3), "cause": r.cause or None,
                "outage_limit": agent.config.outage_limit,
                "waiting": agent.waiting.as_status() if agent.waiting is not None else None}

    async def connect(self) -> None:
        """Take this node's lease (once). An unreachable etcd is retried until
        ``join_timeout`` (nodes often start before the service is up: a c10d host's etcd
        among them); raises ``RendezvousError`` if etcd is still unreachable then, or
        refuses. Each try is bounded by one lease TTL."""
        agent, config = self._agent, self._agent.config
        if agent.lease.id:
            return
        deadline = time.monotonic() + config.join_timeout
        last = "no answer"
        clock = WaitClock(time.monotonic(), time.time(), config.wait_report_every,
                          next_due_now=True)
        self._connecting = clock  # the client's first failed pass reports (on_reachability)
        try:
            with etcd_errors(f"taking a lease from {', '.join(config.endpoints)}"):
                while True:
                    try:
                        with anyio.fail_after(max(deadline - time.monotonic(), 0.01)):
                            await agent.lease.grant(bounded=True)
                        return
                    except (EtcdUnavailable, TimeoutError) as exc:
                        if time.monotonic() >= deadline:
                            why = str(exc) or agent.client.reachability.cause or last
                            message = f"unreachable for {config.join_timeout:g}s: {why}"
                            raise EtcdUnavailable(message) from exc
                        last = str(exc) or last
                        self._report_unreachable(clock, last)
        finally:
            self._connecting = None

    def _report_unreachable(self, clock: WaitClock, last: str) -> None:
        """A WARNING at the first pass that found no member answering (not a whole bounded
        try later), then every 30 s while etcd does not answer at start-up: the endpoints,
        the error and how long the node keeps trying."""
        config = self._agent.config
        now = time.monotonic()
        if not clock.due(now):
            return
        clock.reported(now)
        cause = self._agent.client.reachability.cause or last
        if unresolved(cause) or not clock.cause:
            clock.cause = cause  # a name that did not resolve stays the cause of this wait
        elif unresolved(clock.cause):
            cause = clock.cause  # later tries may time out inside the resolver instead
        what = (f"etcd at {', '.join(config.endpoints)}" if config.service == "etcd"
                else config.service)  # c10d: the rendezvous host, not an etcd
        wait = WaitProgress(f"{what} to answer",
                            clock.started_wall, clock.waited(now), cause=cause)
        # a WARNING, not INFO: the node does nothing until it answers, and a wrong endpoint
        # never starts to answer (join_timeout bounds the wait)
        remaining = max(0.0, config.join_timeout - clock.waited(now))
        logger.warning("%s; retrying for %.0fs more (join_timeout %gs: --rdzv-conf "
                       "join_timeout=SECONDS)", wait.line(), remaining, config.join_timeout)

    def on_reachability(self, reachable: bool, r: Reachability) -> None:
        agent = self._agent
        if not agent.lease.id:  # start-up: connect() reports in one line, at once
            if not reachable and self._connecting is not None:
                self._report_unreachable(self._connecting, r.cause)
            return
        if reachable:
            logger.warning("%s reachable again after %.1fs", agent.config.service,
                           r.last_outage)
            self.cutoff.outage_ended()
            for deadline in agent.deadlines:
                if not agent.spare:  # a spare's join_timeout stays paused
                    deadline.resume()
            agent.emit("etcd_reachable", outage=round(r.last_outage, 3), outages=r.outages)
            return
        limit = agent.config.outage_limit
        logger.warning("%s unreachable (%s); the workers run on, waiting for it %s",
                       agent.config.service, r.cause,
                       "for as long as it takes" if limit is None else f"for up to {limit:g}s")
        for deadline in agent.deadlines:
            deadline.pause()
        self.cutoff.outage_began()
        agent.emit("etcd_unreachable", cause=r.cause, outage_limit=limit)

    def _standing_since(self) -> float:
        return standing_since(self._agent.lease.last_refresh_sent,
                              self._agent.client.reachability.recovered_at)

    def watch_live(self, live: bool) -> None:
        """A stream of the control watch opened or closed: /status changes (publish it)."""
        agent = self._agent
        if agent.lease.id and not agent.closed.is_set():
            agent.emit("etcd_watch", live=live,
                       endpoint=agent.ctl.watch_endpoint if agent.ctl else None,
                       endpoints=list(agent.ctl.watch_endpoints) if agent.ctl else [])

    def _cut_off(self, reason: str) -> None:
        """The cut-off rule says this node is out of the job (``core.partition``): its
        round is over; its workers stop and it joins the next round when etcd answers."""
        self._agent.cut_off_reason = reason
        logger.warning("%s: %s", self._agent.config.label, reason)
        self._agent.emit("etcd_cut_off", reason=reason)
        self._agent.notify_ctl()

    def _peer_left(self, node: str, round_: int) -> None:
        """A peer told this node directly that it left ``round_`` and confirmed it, and
        etcd has shown nothing for ``GRACE``: the round is over here too."""
        agent = self._agent
        if agent.ctl is None or round_ != self.cutoff.round or agent.state().round > round_:
            return  # this node moved on meanwhile, or etcd told it first
        reason = (f"node(s) lost: {node} (it left round {round_} and told this node "
                  "directly; etcd has not committed it yet)")
        logger.warning("%s: %s", agent.config.label, reason)
        agent.emit("peer_left_told", node=node, round=round_)
        agent.told_left = (round_, reason)
        agent.notify_ctl()

    async def _answers_within(self, seconds: float) -> bool:
        """Whether etcd serves a linearizable read (it has a raft leader and this node
        reaches it) within ``seconds``."""
        with anyio.move_on_after(seconds):
            try:
                await self._agent.client.range(self._agent.keys.round, retry_window=0)
            except EtcdError:
                return False
            return True
        return False

    async def lease_replaced(self, across_outage: bool) -> None:
        """The lease expired and a new one was granted: restore this agent's keys if it
        expired across an outage; otherwise the others saw this node leave: say so."""
        agent = self._agent
        agent.emit("etcd_lease_replaced", lease=f"{agent.lease.id:x}",
                   across_outage=across_outage)
        if not across_outage:
            agent.evicted = True
            agent.evicted_reason = "its lease expired while etcd was reachable"
            agent.held.clear()
            agent.joined = agent.waiting_in = -1
            agent.notify_ctl()
            return
        running = agent.keys.node(agent.last_round, "join", agent.node_id)
        lost_running = False
        for key, (value, guard) in list(agent.held.items()):
            try:
                result = await agent.client.txn(guard,
                                                [put_op(key, value, lease=agent.lease.id)])
            except EtcdError as exc:
                logger.warning("cannot restore %s after the outage: %s", key, exc)
                result = None
            if result is None or not result.succeeded:
                agent.held.pop(key, None)  # the job moved on meanwhile
                lost_running = lost_running or key == running
        logger.info("restored %d etcd key(s) under the new lease %x", len(agent.held),
                    agent.lease.id)
        if lost_running:  # not a member any more: act now, not when a stream says so
            await self._evicted_after_outage()

    async def _evicted_after_outage(self) -> None:
        agent = self._agent
        if agent.ctl is not None:
            try:  # so that a round opened meanwhile is the reason given, if it was
                with anyio.move_on_after(agent.client.timeout):
                    await agent.ctl.refresh()
            except EtcdError as exc:
                logger.debug("cannot re-read the control keys: %s", exc)
        agent.evicted = True
        agent.evicted_reason = (f"its join key of round {agent.last_round} could not be "
                                "restored after the etcd outage: the job went on without it")
        agent.joined = -1
        logger.warning("%s: this node is no longer a member: %s", agent.config.label,
                       agent.evicted_reason)
        agent.notify_ctl()
