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

import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskStatus

from supervisor.core.nodehealth import Limits
from supervisor.core.partition import standing_since
from supervisor.core.peers import PeerCheck
from supervisor.rendezvous.base import (
    BarrierResult,
    Capabilities,
    EtcdService,
    NodeLedger,
    RendezvousClosed,
    RendezvousError,
    RendezvousResult,
    free_port,
)
from supervisor.rendezvous.etcd.config import (
    EtcdRendezvousConfig,
    RendezvousConfigError,
    make_config,
    parse_endpoints,
    parse_nnodes,
    parse_rdzv_conf,
)
from supervisor.rendezvous.etcd.cutoff import CutoffCheck
from supervisor.rendezvous.etcd.keys import (
    ROOT,
    Keys,
    Member,
    Policy,
    State,
    advance_txn,
    close_job_txn,
    round_guard,
)
from supervisor.rendezvous.etcd.leader import Leader
from supervisor.rendezvous.etcd.lease import LeaseKeeper, PausableDeadline
from supervisor.rendezvous.etcd.leave_notice import LeaveNotices
from supervisor.rendezvous.etcd.node_records import EtcdNodeLedger
from supervisor.rendezvous.etcd.peers import check_peers
from supervisor.rendezvous.etcd.sameid import ended_line, meet, shape_value
from supervisor.rendezvous.etcd.waitreport import WaitClock, WaitProgress, unresolved
from supervisor.rendezvous.etcd.wire.client import (
    EtcdClient,
    EtcdError,
    EtcdLeaseNotFound,
    EtcdUnavailable,
    JsonDict,
    Reachability,
    compare,
    hedge_delay,
    put_op,
)
from supervisor.rendezvous.etcd.wire.decode import BadValue, bounded
from supervisor.rendezvous.etcd.wire.watch import PrefixView, open_prefix_view

__all__ = [
    "ROOT", "EtcdRendezvous", "EtcdRendezvousConfig", "RendezvousConfigError", "make_config",
    "open_etcd_rendezvous", "parse_endpoints", "parse_nnodes", "parse_rdzv_conf",
]

logger = logging.getLogger("supervisor.rendezvous.etcd")  # the backend's lines, whichever module

_CAS_ATTEMPTS = 50
PEER_LEARNING_BOUND = 1.0  # seconds a completed round may spend reading its peers' URLs
_Done = tuple[list[Member], tuple[str, int]]  # a finished round: members, (addr, port)
EventHook = Callable[..., object]  # EventLog.emit(kind, **fields)


@contextmanager
def _etcd_errors(what: str) -> Iterator[None]:
    try:
        yield
    except EtcdError as exc:
        raise RendezvousError(f"etcd rendezvous: {what} failed: {exc}") from exc


class EtcdRendezvous:
    """The ``Rendezvous`` backend over etcd v3. Start ``run`` in a task group first.

    ``on_event`` (for example ``EventLog.emit``) hears ``etcd_unreachable``,
    ``etcd_reachable`` and ``etcd_lease_replaced``; ``reachability`` and ``stats`` are the
    client's live counters (outages, requests, conflicts, watch events)."""

    backend = "etcd"
    capabilities = Capabilities(membership_can_change=True, coordinates_nodes=True,
                                job_status=True)

    def __init__(self, config: EtcdRendezvousConfig, *, on_event: EventHook | None = None
                 ) -> None:
        self.config = config
        self.run_id = config.run_id
        self.node_id = config.node_id
        self.on_event = on_event
        self._keys = Keys(config.run_id)
        self._policy = Policy(config.min_nodes, config.max_nodes, config.last_call_timeout)
        # Each attempt is bounded so that a hung member is skipped within one TTL.
        timeout = min(config.request_timeout, config.lease_ttl / 3)
        self._client = EtcdClient(config.endpoints, timeout=timeout,
                                  tls=config.tls, user=config.user, password=config.password,
                                  retry_window=config.outage_limit,
                                  on_reachability=self._on_reachability,
                                  hedge_after=hedge_delay(timeout), service=config.service)
        self._lease = LeaseKeeper(self._client, config.lease_ttl, self._lease_replaced,
                                  service=config.service)
        self._leader = Leader(self._client, self._keys, self._policy, self._lease,
                              config.node_id)
        self._cutoff = CutoffCheck(self._client, config.run_id, config.node_id,
                                   ttl=config.lease_ttl,
                                   last_refresh_sent=self._standing_since,
                                   on_cut_off=self._cut_off)
        self._cut_off_reason: str | None = None  # this node is the one cut off from etcd
        self.notices = LeaveNotices(self._cutoff, config.run_id, config.node_id,
                                    on_peer_left=self._peer_left,
                                    etcd_answers=self._answers_within)
        self._told_left: tuple[int, str] | None = None  # a peer's leave, told directly
        self._advance_reason = ""  # why this node opens the next round itself
        self._left_round: int | None = None  # the round it ran when it left (/status)
        self._evicted_reason = ""
        self._ctl: PrefixView | None = None
        self._ready = anyio.Event()
        self._running = False
        self._run_active = False
        self._run_exited = anyio.Event()
        self._left = False
        self._closed = anyio.Event()
        self._last_round = -1  # the last round this node was handed
        self._joined = -1  # the round this node's join key is in (-1: none)
        self._waiting = -1  # the round this node's wait key is in
        self._spare = False  # waiting beyond max_nodes: join_timeout does not run
        self._was_spare = False  # since the last round this node was handed
        self._evicted = False  # lease lost while etcd was reachable: the others saw it go
        self._held: dict[str, tuple[str, list[JsonDict]]] = {}  # lease-bound: value, guard
        self._deadlines: set[PausableDeadline] = set()
        self._progress = "nothing read yet"
        self._clock: WaitClock | None = None  # the round being waited for, if any
        self._connecting: WaitClock | None = None  # connect() waiting for etcd to answer
        self.waiting: WaitProgress | None = None  # for /status: what next_round waits for
        self.joined_at = 0.0  # monotonic: this agent's last join key was written
        self.waited_at = 0.0  # monotonic: this agent's last wait key was written

    @property
    def lease_id(self) -> int:
        """This agent's etcd lease (0 before ``connect``)."""
        return self._lease.id

    @property
    def stats(self) -> dict[str, int]:
        """Requests, txn conflicts, retries and watch events of this agent's client."""
        return self._client.stats.as_dict()

    @property
    def reachability(self) -> Reachability:
        return self._client.reachability

    def outage_status(self) -> dict[str, Any]:
        """For ``/status``: whether etcd answers (to requests and to this node's watch:
        never "reachable" while the watch is dead), and the outages so far."""
        r = self._client.reachability
        now = time.monotonic()
        watch_live = self._ctl is not None and self._ctl.watch_live
        reachable = r.unreachable_since is None and watch_live
        return {"reachable": reachable,
                # since when etcd answers again after an outage: the peers' cut-off rule
                "recovered_for": (round(now - r.recovered_at, 3)
                                  if reachable and r.recovered_at is not None else None),
                "requests_answered": r.unreachable_since is None,
                "watch": {"live": watch_live,
                          "endpoint": self._ctl.watch_endpoint if self._ctl else None,
                          "endpoints": list(self._ctl.watch_endpoints) if self._ctl else [],
                          "resyncs": self._ctl.resyncs if self._ctl else 0},
                "cut_off": self._cut_off_reason,
                "left_round": self._left_round,
                "unreachable_for": round(r.outage_age(now), 3),
                "outages": r.outages, "last_outage": round(r.last_outage, 3),
                "total_outage": round(r.total_outage, 3), "cause": r.cause or None,
                "outage_limit": self.config.outage_limit,
                "waiting": self.waiting.as_status() if self.waiting is not None else None}

    # lifecycle

    def extra_pids(self) -> list[int]:
        return []

    def etcd_service(self) -> EtcdService:
        return self

    async def connect(self) -> None:
        """Take this node's lease (once). An unreachable etcd is retried until
        ``join_timeout`` (nodes often start before the service is up: a c10d host's etcd
        among them); raises ``RendezvousError`` if etcd is still unreachable then, or
        refuses. Each try is bounded by one lease TTL."""
        if self._lease.id:
            return
        deadline = time.monotonic() + self.config.join_timeout
        last = "no answer"
        clock = WaitClock(time.monotonic(), time.time(), self.config.wait_report_every,
                          next_due_now=True)
        self._connecting = clock  # the client's first failed pass reports (_on_reachability)
        try:
            with _etcd_errors(f"taking a lease from {', '.join(self.config.endpoints)}"):
                while True:
                    try:
                        with anyio.fail_after(max(deadline - time.monotonic(), 0.01)):
                            await self._lease.grant(bounded=True)
                        return
                    except (EtcdUnavailable, TimeoutError) as exc:
                        if time.monotonic() >= deadline:
                            why = str(exc) or self._client.reachability.cause or last
                            message = f"unreachable for {self.config.join_timeout:g}s: {why}"
                            raise EtcdUnavailable(message) from exc
                        last = str(exc) or last
                        self._report_unreachable(clock, last)
        finally:
            self._connecting = None

    def _report_unreachable(self, clock: WaitClock, last: str) -> None:
        """A WARNING at the first pass that found no member answering (not a whole bounded
        try later), then every 30 s while etcd does not answer at start-up: the endpoints,
        the error and how long the node keeps trying."""
        now = time.monotonic()
        if not clock.due(now):
            return
        clock.reported(now)
        cause = self._client.reachability.cause or last
        if unresolved(cause) or not clock.cause:
            clock.cause = cause  # a name that did not resolve stays the cause of this wait
        elif unresolved(clock.cause):
            cause = clock.cause  # later tries may time out inside the resolver instead
        what = (f"etcd at {', '.join(self.config.endpoints)}" if self.config.service == "etcd"
                else self.config.service)  # c10d: the rendezvous host, not an etcd
        wait = WaitProgress(f"{what} to answer",
                            clock.started_wall, clock.waited(now), cause=cause)
        # a WARNING, not INFO: the node does nothing until it answers, and a wrong endpoint
        # never starts to answer (join_timeout bounds the wait)
        remaining = max(0.0, self.config.join_timeout - clock.waited(now))
        logger.warning("%s; retrying for %.0fs more (join_timeout %gs: --rdzv-conf "
                       "join_timeout=SECONDS)", wait.line(), remaining, self.config.join_timeout)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Connect (if not yet), follow the control keys, report ready, then keep the lease
        alive and campaign for leadership until ``aclose()`` or cancellation; leaves and
        releases everything on the way out."""
        self._run_active = True
        try:
            await self.connect()
            with _etcd_errors("reading the job's control keys"):
                # bounded like connect(): the supervisor is still starting
                async with open_prefix_view(self._client, self._keys.ctl,
                                            retry_window=self.config.lease_ttl,
                                            on_live=self._watch_live) as view:
                    self._ctl = view
                    self._running = True
                    self._ready.set()
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(self._campaign)
                        tg.start_soon(self._cutoff.run)
                        tg.start_soon(self.notices.run)
                        task_status.started()
                        await self._lease.keep_alive()
                        await self._closed.wait()
                        tg.cancel_scope.cancel()
        finally:
            self._run_active = False
            self._run_exited.set()
            with anyio.CancelScope(shield=True):
                await self.aclose()

    async def leave(self, *, tell_peers: bool = True) -> None:
        """Revoke the lease: this node's keys vanish, the others re-form; the job goes on.
        With ``tell_peers`` (a graceful leave; not when the run is simply over), a node
        that runs a round also tells its peers directly (``core.leave_notice``), for when
        etcd cannot commit the revoke at once."""
        if not self._left:
            self._left = True
            if not self._lease.id:
                return  # never joined (etcd was unreachable): nothing to leave
            round_ = self._cutoff.round
            async with anyio.create_task_group() as tg:
                if tell_peers and round_ >= 0:
                    self._left_round = round_
                    self._emit("rendezvous_left", round=round_)  # /status says so first
                    tg.start_soon(self.notices.tell, round_)
                with anyio.move_on_after(self.config.request_timeout):
                    await self._lease.revoke()
            logger.info("left %s %s as %s", self.config.label, self.run_id, self.node_id)

    async def aclose(self) -> None:
        """Leave (if not done yet) and close connections. Idempotent."""
        if self._closed.is_set():
            return
        await self.leave(tell_peers=False)
        self._closed.set()
        if self._run_active:  # let run() close its watches before the session goes
            with anyio.move_on_after(self.config.request_timeout):
                await self._run_exited.wait()
        await self._client.aclose()

    async def _usable(self) -> None:
        """Wait until ``run`` follows the control keys; raise if it cannot be used."""
        if not (self._run_active or self._running):
            raise RuntimeError("EtcdRendezvous.run() must be started before use")
        await self._ready.wait()
        self._check_usable()

    def _check_usable(self) -> None:
        if not self._running:
            raise RuntimeError("EtcdRendezvous.run() must be started before use")
        if self._left:
            raise RendezvousError("this node already left the etcd rendezvous")
        if self._lease.given_up.is_set():
            raise RendezvousError(self._lease.given_up_reason)

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.on_event is not None:
            self.on_event(kind, **fields)

    # outages

    def _on_reachability(self, reachable: bool, r: Reachability) -> None:
        if not self._lease.id:  # start-up: connect() reports in one line, at once
            if not reachable and self._connecting is not None:
                self._report_unreachable(self._connecting, r.cause)
            return
        if reachable:
            logger.warning("%s reachable again after %.1fs", self.config.service, r.last_outage)
            self._cutoff.outage_ended()
            for deadline in self._deadlines:
                if not self._spare:  # a spare's join_timeout stays paused
                    deadline.resume()
            self._emit("etcd_reachable", outage=round(r.last_outage, 3), outages=r.outages)
            return
        limit = self.config.outage_limit
        logger.warning("%s unreachable (%s); the workers run on, waiting for it %s",
                       self.config.service, r.cause,
                       "for as long as it takes" if limit is None else f"for up to {limit:g}s")
        for deadline in self._deadlines:
            deadline.pause()
        self._cutoff.outage_began()
        self._emit("etcd_unreachable", cause=r.cause, outage_limit=limit)

    def _standing_since(self) -> float:
        return standing_since(self._lease.last_refresh_sent,
                              self._client.reachability.recovered_at)

    def _watch_live(self, live: bool) -> None:
        """A stream of the control watch opened or closed: /status changes (publish it)."""
        if self._lease.id and not self._closed.is_set():
            self._emit("etcd_watch", live=live,
                       endpoint=self._ctl.watch_endpoint if self._ctl else None,
                       endpoints=list(self._ctl.watch_endpoints) if self._ctl else [])

    def _cut_off(self, reason: str) -> None:
        """The cut-off rule says this node is out of the job (``core.partition``): its
        round is over; its workers stop and it joins the next round when etcd answers."""
        self._cut_off_reason = reason
        logger.warning("%s: %s", self.config.label, reason)
        self._emit("etcd_cut_off", reason=reason)
        self._notify_ctl()

    def _peer_left(self, node: str, round_: int) -> None:
        """A peer told this node directly that it left ``round_`` and confirmed it, and
        etcd has shown nothing for ``GRACE``: the round is over here too."""
        if self._ctl is None or round_ != self._cutoff.round or self._state().round > round_:
            return  # this node moved on meanwhile, or etcd told it first
        reason = (f"node(s) lost: {node} (it left round {round_} and told this node "
                  "directly; etcd has not committed it yet)")
        logger.warning("%s: %s", self.config.label, reason)
        self._emit("peer_left_told", node=node, round=round_)
        self._told_left = (round_, reason)
        self._notify_ctl()

    async def _answers_within(self, seconds: float) -> bool:
        """Whether etcd serves a linearizable read (it has a raft leader and this node
        reaches it) within ``seconds``."""
        with anyio.move_on_after(seconds):
            try:
                await self._client.range(self._keys.round, retry_window=0)
            except EtcdError:
                return False
            return True
        return False

    @contextmanager
    def _join_deadline(self) -> Iterator[anyio.CancelScope]:
        """A cancel scope of ``join_timeout`` that does not run while etcd is unreachable."""
        with anyio.CancelScope() as scope:
            deadline = PausableDeadline(scope, self.config.join_timeout)
            if self._client.reachability.unreachable_since is not None:
                deadline.pause()
            self._deadlines.add(deadline)
            try:
                yield scope
            finally:
                self._deadlines.discard(deadline)

    async def _lease_replaced(self, across_outage: bool) -> None:
        """The lease expired and a new one was granted: restore this agent's keys if it
        expired across an outage; otherwise the others saw this node leave: say so."""
        self._emit("etcd_lease_replaced", lease=f"{self._lease.id:x}", across_outage=across_outage)
        if not across_outage:
            self._evicted = True
            self._evicted_reason = "its lease expired while etcd was reachable"
            self._held.clear()
            self._joined = self._waiting = -1
            self._notify_ctl()
            return
        running = self._keys.node(self._last_round, "join", self.node_id)
        lost_running = False
        for key, (value, guard) in list(self._held.items()):
            try:
                result = await self._client.txn(guard, [put_op(key, value, lease=self._lease.id)])
            except EtcdError as exc:
                logger.warning("cannot restore %s after the outage: %s", key, exc)
                result = None
            if result is None or not result.succeeded:
                self._held.pop(key, None)  # the job moved on meanwhile
                lost_running = lost_running or key == running
        logger.info("restored %d etcd key(s) under the new lease %x", len(self._held),
                    self._lease.id)
        if lost_running:  # not a member any more: act now, not when a stream says so
            if self._ctl is not None:
                try:  # so that a round opened meanwhile is the reason given, if it was
                    with anyio.move_on_after(self._client.timeout):
                        await self._ctl.refresh()
                except EtcdError as exc:
                    logger.debug("cannot re-read the control keys: %s", exc)
            self._evicted = True
            self._evicted_reason = (f"its join key of round {self._last_round} could not be "
                                    "restored after the etcd outage: the job went on without it")
            self._joined = -1
            logger.warning("%s: this node is no longer a member: %s", self.config.label,
                           self._evicted_reason)
            self._notify_ctl()

    def _notify_ctl(self) -> None:
        if self._ctl is not None:
            self._ctl.poke()  # waiters re-check this agent's own state

    # the control view

    def _state(self) -> State:
        assert self._ctl is not None
        return State(self._keys, self._ctl.kvs)

    async def _wait(self, seen: int, until: float = math.inf) -> None:
        """Until the control view moves past version ``seen``, ``until`` (monotonic)
        passes or the rendezvous gave up."""
        assert self._ctl is not None
        failure: EtcdError | None = None
        with anyio.move_on_after(until - time.monotonic()):
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._cancel_on_give_up, tg.cancel_scope)
                try:
                    await self._ctl.wait_changed(seen)
                except EtcdError as exc:  # raised below, not wrapped in an ExceptionGroup
                    failure = exc
                tg.cancel_scope.cancel()
        if isinstance(failure, EtcdUnavailable):  # the watch waited out outage_limit
            self._lease.give_up(failure)
        elif failure is not None:
            raise failure
        self._check_usable()

    async def _cancel_on_give_up(self, scope: anyio.CancelScope) -> None:
        await self._lease.given_up.wait()
        scope.cancel()

    async def _write(self, compares: list[JsonDict], success: list[JsonDict], *,
                     seen_in_view: bool = True) -> bool:
        """A guarded txn. On success wait until the view has its effect (the watch brings
        it: no re-read) unless it wrote outside ``ctl/``; on a conflict re-read the control
        keys once, so the next decision sees what changed."""
        assert self._ctl is not None
        result = await self._client.txn(compares, success)
        if not result.succeeded:
            await self._ctl.refresh()
        elif seen_in_view:
            with anyio.move_on_after(self._client.timeout):
                await self._ctl.wait_revision(result.revision)
        return result.succeeded

    async def _put_held(self, key: str, value: str, guard: list[JsonDict], *,
                        seen_in_view: bool, restore_guard: list[JsonDict] | None = None
                        ) -> bool:
        """Put a lease-bound key of this agent, remembered (with the comparisons that must
        still hold then, default ``guard``) for restoring it after an outage."""
        lease = self._lease.id
        try:
            ok = await self._write(guard, [put_op(key, value, lease=lease)],
                                   seen_in_view=seen_in_view)
        except EtcdLeaseNotFound:  # expired across an outage, not replaced yet: now
            await self._lease.replace(lease)
            return False
        if ok:
            self._held[key] = (value, guard if restore_guard is None else restore_guard)
        return ok

    @asynccontextmanager
    async def _closing_on_bad_value(self) -> AsyncIterator[None]:
        """A value this node cannot read ends the job here: close it for the others too
        (best effort, bounded), so that none waits for this node until a timeout."""
        try:
            yield
        except BadValue as exc:
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.config.lease_ttl):
                try:
                    await self._close(ok=False, reason=str(exc))
                except EtcdError as error:
                    logger.warning("cannot close the job for the other nodes: %s", error)
            raise

    # rounds

    async def next_round(self, local_world_size: int) -> RendezvousResult:
        """Join the next round and wait until it completes: at most ``join_timeout`` while
        etcd answers, plus any outage (bounded by ``outage_limit``)."""
        await self._usable()
        self._evicted, self._cut_off_reason = False, None
        # a round this node opens itself says why (the others' goodput causes read it)
        self._advance_reason = self._told_left[1] if self._told_left else ""
        self._told_left = None
        self._cutoff.round_ended()
        started = time.monotonic()
        result: RendezvousResult | None = None
        self._clock = WaitClock(started, time.time(), self.config.wait_report_every)
        self.waiting = WaitProgress("this node's next round", self._clock.started_wall, 0.0,
                                    needed=self.config.min_nodes, max_nodes=self.config.max_nodes)
        try:
            async with self._closing_on_bad_value():
                with _etcd_errors("joining a round"), self._join_deadline():
                    if self._last_round < 0 and self._joined < 0:
                        await self._arrive(local_world_size)
                    result = await self._rendezvous(local_world_size, started)
        finally:
            self._clock, self.waiting = None, None
        if result is None:
            raise RendezvousError(f"etcd rendezvous {self.run_id} timed out after "
                                  f"{self.config.join_timeout:g}s: {await self._describe()}")
        with anyio.move_on_after(PEER_LEARNING_BOUND):  # a few reads; never delays a round long
            await self._cutoff.learn_peers()
        logger.info("%s round %d complete in %.3fs: group rank %d of %d, "
                    "master %s:%d", self.config.label, result.round, result.duration,
                    result.group_rank, result.group_world_size, result.master_addr,
                    result.master_port)
        return result

    async def _arrive(self, lws: int) -> None:
        """Before this node first joins: has it met another job under the same run id?
        (``supervisor.rendezvous.etcd.sameid``) Records the job's shape if nobody did yet."""
        state, key = self._state(), self._keys.ctl + "shape"
        shape = msgspec.to_builtins(state.shape) if state.shape else None  # bad: ignored
        members = state.members(state.round)
        closed = msgspec.to_builtins(state.closed) if state.closed else None
        verdict = meet(self.run_id, closed=closed, shape=shape,
                       running_sizes=[m.local_world_size for m in members] if members else None,
                       min_nodes=self.config.min_nodes, max_nodes=self.config.max_nodes,
                       nproc_per_node=lws)
        if verdict is not None and verdict.fatal:
            raise RendezvousClosed(f"etcd rendezvous: {verdict.line}")
        if verdict is not None:
            logger.warning("%s: %s", self.config.label, verdict.line)
        if state.kv(key) is None:
            value = shape_value(self.config.min_nodes, self.config.max_nodes, lws)
            await self._write([compare(key, "VERSION", "=", 0)], [put_op(key, value)])

    async def _describe(self) -> str:
        """Where the round stands, for a timeout message (one count request, best effort)."""
        n = self._state().round
        if self._state().members(n) is not None:
            return self._progress
        count = await self._joined_count(n)
        if count is None:
            return self._progress
        return (f"round {n}: {count} node(s) joined, need {self.config.min_nodes} "
                f"(max {self.config.max_nodes})")

    async def _joined_count(self, n: int) -> int | None:
        """How many nodes joined round n (one count request, best effort: None)."""
        try:
            with anyio.move_on_after(self._client.timeout):
                return await self._client.count(self._keys.node(n, "join"), prefix=True)
        except EtcdError:
            pass
        return None

    async def _report_wait(self) -> None:
        """Every 30 s while next_round waits: one line, ``/status`` and an event; at the
        first wait ``/status`` and the event only (most rounds complete in a moment)."""
        clock, now = self._clock, time.monotonic()
        if clock is None or not (clock.due(now) or not clock.announced):
            return
        first, clock.announced = not clock.announced, True
        clock.reported(now)
        n = self._state().round
        running = self._state().members(n) is not None
        what = (f"admission ({self._progress})" if running and self._waiting == n
                else f"nodes to join round {n}")
        self.waiting = WaitProgress(
            what, clock.started_wall, clock.waited(now),
            joined=None if running else await self._joined_count(n),
            needed=self.config.min_nodes, max_nodes=self.config.max_nodes)
        logger.log(logging.DEBUG if first else logging.INFO, "%s %s: %s", self.config.label,
                   self.run_id, self.waiting.line())
        self._emit("rendezvous_waiting", **self.waiting.as_status())

    async def _rendezvous(self, lws: int, started: float) -> RendezvousResult:
        assert self._ctl is not None
        while True:
            seen, state = self._ctl.version, self._state()
            if state.closed is not None and self._last_round < 0:
                ended = ended_line(self.run_id, msgspec.to_builtins(state.closed))
                raise RendezvousClosed(f"etcd rendezvous: {ended}")
            if state.closed is not None:
                raise RendezvousClosed(f"job {self.run_id} is closed: {state.closed.reason}",
                                       succeeded=bool(state.closed.ok))
            done = await self._step(state, lws)
            if isinstance(done, tuple):
                return self._result(state.round, *done, started)
            if not done:
                await self._report_wait()
                await self._wait(seen, self._clock.next_due if self._clock else math.inf)

    async def _step(self, state: State, lws: int) -> _Done | bool:
        """One decision: a finished round, or whether something was written (decide again
        now) rather than waiting for a change."""
        n = state.round
        members = state.members(n)
        if members is None:
            if self._joined == n:
                self._progress = f"round {n}: joined; waiting for the leader to close it"
                return False
            return await self._join(state, n, lws) or True
        if self.node_id in {m.node for m in members} and self._joined == n:
            if n > self._last_round:
                return await self._finishing(state, n, members)
            # restarting from a round it already ran
            await self._advance(state, n, self._advance_reason)
            return True
        return await self._waiting_room(state, n, members)

    async def _join(self, state: State, n: int, lws: int) -> bool:
        self._set_spare(False)
        me = Member(self.node_id, self.config.local_addr, lws)
        same_round = round_guard(state)
        guard = [*same_round, compare(self._keys.result(n), "VERSION", "=", 0)]
        # restored after an outage even once the round is complete: it is still a member
        ok = await self._put_held(self._keys.node(n, "join", self.node_id),
                                  json.dumps(asdict(me)), guard, seen_in_view=False,
                                  restore_guard=same_round)
        if ok:
            self._joined, self.joined_at = n, time.monotonic()
        return ok

    async def _finishing(self, state: State, n: int, members: list[Member]) -> _Done | bool:
        master = state.master(n)
        if master is not None:
            return members, master
        if members[0].node != self.node_id:
            self._progress = f"round {n}: waiting for group rank 0 to publish the master port"
            return False
        addr = self.config.local_addr
        await self._write(
            [*round_guard(state), compare(self._keys.master(n), "VERSION", "=", 0)],
            [put_op(self._keys.master(n), json.dumps({"addr": addr, "port": free_port(addr)}))])
        return True

    async def _waiting_room(self, state: State, n: int, members: list[Member]) -> bool:
        """This node is not in round n: ask to be admitted (the leader opens a new round
        when there is room, or when round n lost a member)."""
        if self._waiting != n:
            ok = await self._put_held(self._keys.node(n, "wait", self.node_id), "{}",
                                      round_guard(state), seen_in_view=False)
            if ok:
                self._waiting, self.waited_at = n, time.monotonic()
            return True
        self._progress = (f"waiting to be admitted: round {n} runs with {len(members)} "
                          f"node(s) (max {self.config.max_nodes})")
        if len(members) >= self.config.max_nodes:
            self._set_spare(True, round=n)
        return False

    def _set_spare(self, spare: bool, **fields: Any) -> None:
        """A node beyond max_nodes is a spare: it waits for as long as the job runs
        (join_timeout is paused) and is admitted by the next round that has room."""
        if spare == self._spare:
            return
        self._spare = spare
        self._was_spare = self._was_spare or spare
        for deadline in self._deadlines:
            if spare:
                deadline.pause()
            elif self._client.reachability.unreachable_since is None:
                deadline.resume()
        if spare:
            logger.info("%s: waiting as a spare (%s)", self.config.label, self._progress)
            self._emit("spare_waiting", **fields)
        else:
            self._emit("spare_joining")

    @property
    def spare(self) -> bool:
        """This node waits as a spare (beyond max_nodes, the round is full)."""
        return self._spare

    async def _advance(self, state: State, n: int, reason: str) -> bool:
        """Open round n+1 (if nobody did yet) and forget round n-1."""
        ok = await self._write(*advance_txn(state, reason, self.node_id))
        if ok:
            logger.info("%s: opened round %d%s", self.config.label, n + 1,
                        f" ({reason})" if reason else "")
        return ok

    def _result(self, n: int, members: list[Member], master: tuple[str, int],
                started: float) -> RendezvousResult:
        ids = [m.node for m in members]
        rank = ids.index(self.node_id)
        sizes = [m.local_world_size for m in members]
        self._last_round, self._advance_reason = n, ""
        spare, self._was_spare = self._was_spare, False
        self._cutoff.round_started(n, ids)
        return RendezvousResult(
            round=n, group_rank=rank, group_world_size=len(members),
            rank_offset=sum(sizes[:rank]), world_size=sum(sizes),
            master_addr=master[0], master_port=master[1], members=tuple(ids),
            duration=time.monotonic() - started, spare=spare,
        )

    # while the round runs

    async def wait_membership_change(self, result: RendezvousResult) -> str:
        """Return why round ``result`` is outdated: the leader (or a restarting node) opened
        a new round, or the job closed. Raises ``RendezvousError`` if this node's own lease
        was lost while etcd was reachable (the others saw it leave)."""
        await self._usable()
        assert self._ctl is not None
        async with self._closing_on_bad_value():
            with _etcd_errors("watching membership"):
                while True:
                    seen = self._ctl.version
                    reason = self._membership_change(self._state(), result)
                    if reason is not None:
                        logger.info("%s round %d outdated: %s", self.config.label, result.round,
                                    reason)
                        return reason
                    await self._wait(seen)

    def _membership_change(self, state: State, result: RendezvousResult) -> str | None:
        if state.closed is not None:
            return f"job closed: {state.closed.reason}"
        if state.round > result.round:
            return state.round_reason or f"round {state.round} was opened by another node"
        if self._evicted:
            why = self._evicted_reason or "the others saw it leave"
            raise RendezvousError(f"this node's etcd lease was lost (now {self._lease.id:x}): "
                                  f"{why}")
        if self._cut_off_reason is not None:
            return f"cut off from etcd: {self._cut_off_reason}"
        if self._told_left is not None and self._told_left[0] == result.round:
            return self._told_left[1]
        return None

    async def exit_barrier(self, result: RendezvousResult, timeout: float) -> BarrierResult:
        """Mark this node done for the round and wait (at most ``timeout``) until the leader
        saw every member done and closed the job as succeeded; ok=False at once if the job
        failed or moved on."""
        n = result.round
        try:
            with _etcd_errors("exit barrier"), anyio.move_on_after(timeout):
                await self._usable()
                assert self._ctl is not None
                # not lease-bound: it must outlive this node
                await self._client.put(self._keys.node(n, "done", self.node_id), "{}")
                while True:
                    seen, state = self._ctl.version, self._state()
                    verdict = self._barrier_verdict(state, result)
                    if verdict is not None:
                        return await self._after_barrier(state, verdict)
                    await self._ctl.wait_changed(seen)
        except RendezvousError as exc:
            return BarrierResult(False, str(exc))
        pending = await self._pending(result)
        return BarrierResult(False, f"exit barrier timed out after {timeout:g}s waiting for "
                                    f"{', '.join(pending)}")

    async def _pending(self, result: RendezvousResult) -> list[str]:
        """Members not done yet (one read, best effort)."""
        try:
            with anyio.move_on_after(self._client.timeout):
                found = await self._client.range(self._keys.node(result.round, "done"),
                                                 prefix=True)
                done = {kv.key.rsplit("/", 1)[-1] for kv in found.kvs}
                return [m for m in result.members if m not in done]
        except EtcdError:
            pass
        return [m for m in result.members if m != self.node_id]

    def _barrier_verdict(self, state: State, result: RendezvousResult) -> BarrierResult | None:
        closed = state.closed
        if closed is not None:
            if closed.ok:
                return BarrierResult(True, f"all {len(result.members)} node(s) finished")
            return BarrierResult(False, f"job failed: {closed.reason}")
        if state.round > result.round:
            why = state.round_reason
            return BarrierResult(False, f"round {state.round} was opened during the exit "
                                        f"barrier{f' ({why})' if why else ''}")
        return None

    async def _after_barrier(self, state: State, verdict: BarrierResult) -> BarrierResult:
        if not verdict.ok and state.closed is None:
            # The job moved on (a restart opened a new round, or a member was lost and one
            # will be): this node is done and never rejoins, so the others would wait for it
            # until join_timeout. Close the job, as torchrun's finished agent does.
            await self._close(ok=False, reason=f"node {self.node_id} had finished its "
                                               f"workers when {verdict.message}")
        return verdict

    # job-wide

    async def record_failure_restart(self, message: str) -> int:
        """Add one failure restart to the job-wide counter (compare-and-swap on the value
        the control view holds); the new count. Waits out an outage (``outage_limit``)."""
        await self._usable()
        key = self._keys.restarts
        with _etcd_errors("counting a restart"):
            for _ in range(_CAS_ATTEMPTS):
                state = self._state()
                kv, restarts = state.kv(key), state.restarts
                count = (restarts.count if restarts else 0) + 1
                value = json.dumps({"count": count, "last": bounded(message),
                                    "node": self.node_id})
                guard = [compare(key, "MOD", "=", kv.mod_revision if kv else 0)]
                if await self._write(guard, [put_op(key, value)]):
                    return int(count)
        raise RendezvousError("etcd rendezvous: restart counter too contended to update")

    async def restart_count(self) -> int:
        """The job-wide failure restart count for the round this node was handed last:
        as etcd held it when that round was closed (one read at the revision of its
        result). A failure counted since came from that round, so every node launches
        the round with the same count, also one that completes it after a fast failure
        elsewhere was counted. The latest count if that result is gone or compacted."""
        closed = (self._state().kv(self._keys.result(self._last_round))
                  if self._ctl is not None and self._last_round >= 0 else None)
        with _etcd_errors("reading the restart counter"):
            try:
                kv = await self._client.get(
                    self._keys.restarts, revision=closed.mod_revision if closed else 0)
            except EtcdError as exc:
                if closed is None or "compacted" not in str(exc):
                    raise
                kv = await self._client.get(self._keys.restarts)
        restarts = State(self._keys, {kv.key: kv}).restarts if kv else None
        return restarts.count if restarts else 0

    async def fail_job(self, message: str) -> None:
        """Close the job for every node (the first reason recorded wins). Bounded by one
        lease TTL: a node that gives up must not wait out an etcd outage on its way out."""
        with _etcd_errors("closing the job"):
            with anyio.move_on_after(self.config.lease_ttl) as scope:
                await self._close(ok=False, reason=message)
            if scope.cancelled_caught:
                raise RendezvousError(f"etcd rendezvous: closing the job failed: etcd did "
                                      f"not answer within {self.config.lease_ttl}s")
        logger.error("%s %s closed as failed: %s", self.config.label, self.run_id, message)

    def node_ledger(self, limits: Limits) -> NodeLedger:
        """This node's health facts in the job's etcd (``node_records``)."""
        return EtcdNodeLedger(self._client, self._keys.prefix, self.config.health_id,
                              self.node_id, limits, spare=lambda: self._spare)

    async def check_peers(self, result: RendezvousResult, within: float) -> PeerCheck:
        """The other members' health endpoints and leases (``peers``)."""
        return await check_peers(self._client, self._keys, self._cutoff, self.run_id,
                                 self.node_id, result, within)

    async def serve_until_job_ends(self) -> None:
        """Nothing to serve: an external etcd outlives this node."""

    async def wait_job_closed(self) -> None:
        """Until the job is closed for everyone (a quarantined c10d host serves until then)."""
        await self._ready.wait()
        assert self._ctl is not None
        while True:
            seen = self._ctl.version
            if self._state().closed is not None:
                return
            await self._ctl.wait_changed(seen)

    async def _close(self, *, ok: bool, reason: str) -> None:
        await self._client.txn(*close_job_txn(self._keys, ok=ok, reason=reason,
                                              node=self.node_id))

    # leadership

    async def _campaign(self) -> None:
        """Hold the leader key when nobody does, and lead while holding it."""
        assert self._ctl is not None
        delay = 0.05
        while not self._lease.given_up.is_set() and not self._left:  # left: no lease
            seen, leader = self._ctl.version, self._state().leader
            try:
                if leader is None:
                    await self._put_held(self._keys.leader, json.dumps({"node": self.node_id}),
                                         [compare(self._keys.leader, "VERSION", "=", 0)],
                                         seen_in_view=True)
                    continue
                if leader.lease == self._lease.id:
                    await self._leader.lead()
                    continue
                await self._ctl.wait_changed(seen)
                delay = 0.05
            except (EtcdError, RendezvousError) as exc:
                if self._lease.given_up.is_set() or self._closed.is_set():
                    return
                logger.warning("%s leader duty failed, retrying: %s", self.config.label, exc)
                await anyio.sleep(delay)
                delay = min(delay * 2, 2.0)


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
