"""One etcd rendezvous agent's own state and its writes on the job's control keys: what
the parts of the backend (rounds, the exit barrier, outages, leadership) share.

``backend.run`` opens the control view (one watch of ``ctl/``, see ``keys``); every write
is one guarded txn whose effect the view then shows; a lease-bound key of this agent is
remembered with its guard, so that ``outage`` can restore it under a new lease.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio

from supervisor.core.jobstep import ReportSource
from supervisor.rendezvous.base import RendezvousError
from supervisor.rendezvous.etcd.config import EtcdRendezvousConfig
from supervisor.rendezvous.etcd.keys import Keys, State, close_job_txn
from supervisor.rendezvous.etcd.lease import ExpiredHook, LeaseKeeper, PausableDeadline
from supervisor.rendezvous.etcd.waitreport import WaitProgress
from supervisor.rendezvous.etcd.wire.client import (
    EtcdClient,
    EtcdError,
    EtcdLeaseNotFound,
    EtcdUnavailable,
    JsonDict,
    KeyValue,
    Reachability,
    hedge_delay,
    put_op,
)
from supervisor.rendezvous.etcd.wire.decode import BadValue
from supervisor.rendezvous.etcd.wire.watch import PrefixView

logger = logging.getLogger("supervisor.rendezvous.etcd")  # the backend's lines

EventHook = Callable[..., object]  # EventLog.emit(kind, **fields)
ReachabilityHook = Callable[[bool, Reachability], None]


@contextmanager
def etcd_errors(what: str) -> Iterator[None]:
    try:
        yield
    except EtcdError as exc:
        raise RendezvousError(f"etcd rendezvous: {what} failed: {exc}") from exc


class Agent:
    """This agent's client, lease, control view and what it holds in etcd."""

    def __init__(self, config: EtcdRendezvousConfig, *, on_event: EventHook | None,
                 on_reachability: ReachabilityHook, on_lease_expired: ExpiredHook) -> None:
        self.config = config
        self.run_id = config.run_id
        self.node_id = config.node_id
        self.on_event = on_event
        self.keys = Keys(config.run_id)
        # Each attempt is bounded so that a hung member is skipped within one TTL.
        timeout = min(config.request_timeout, config.lease_ttl / 3)
        self.client = EtcdClient(config.endpoints, timeout=timeout,
                                 tls=config.tls, user=config.user, password=config.password,
                                 retry_window=config.outage_limit,
                                 on_reachability=on_reachability,
                                 hedge_after=hedge_delay(timeout), service=config.service)
        self.lease = LeaseKeeper(self.client, config.lease_ttl, on_lease_expired,
                                 service=config.service)
        self.ctl: PrefixView | None = None  # the control view, while run() runs
        self.ready = anyio.Event()
        self.running = False
        self.run_active = False
        self.run_exited = anyio.Event()
        self.left = False
        self.closed = anyio.Event()
        self.last_round = -1  # the last round this node was handed
        self.joined = -1  # the round this node's join key is in (-1: none)
        self.waiting_in = -1  # the round this node's wait key is in
        self.spare = False  # waiting beyond max_nodes: join_timeout does not run
        self.was_spare = False  # since the last round this node was handed
        self.evicted = False  # lease lost while etcd was reachable: the others saw it go
        self.evicted_reason = ""
        self.cut_off_reason: str | None = None  # this node is the one cut off from etcd
        self.told_left: tuple[int, str] | None = None  # a peer's leave, told directly
        self.advance_reason = ""  # why this node opens the next round itself
        self.left_round: int | None = None  # the round it ran when it left (/status)
        self.held: dict[str, tuple[str, list[JsonDict]]] = {}  # lease-bound: value, guard
        self.deadlines: set[PausableDeadline] = set()
        self.progress = "nothing read yet"
        self.waiting: WaitProgress | None = None  # for /status: what next_round waits for
        self.joined_at = 0.0  # monotonic: this agent's last join key was written
        self.snapshot_report: ReportSource | None = None  # its snapshots, told when it joins
        self.waited_at = 0.0  # monotonic: this agent's last wait key was written

    def emit(self, kind: str, **fields: Any) -> None:
        if self.on_event is not None:
            self.on_event(kind, **fields)

    async def usable(self) -> None:
        """Wait until ``run`` follows the control keys; raise if it cannot be used."""
        if not (self.run_active or self.running):
            raise RuntimeError("EtcdRendezvous.run() must be started before use")
        await self.ready.wait()
        self.check_usable()

    def check_usable(self) -> None:
        if not self.running:
            raise RuntimeError("EtcdRendezvous.run() must be started before use")
        if self.left:
            raise RendezvousError("this node already left the etcd rendezvous")
        if self.lease.given_up.is_set():
            raise RendezvousError(self.lease.given_up_reason)

    async def put_control(self, name: str, value: str) -> None:
        """Put ``ctl/<name>``: one write every agent's control watch brings (a value of
        another layer: ``etcd.persist_mark``)."""
        await self.usable()
        with etcd_errors(f"writing ctl/{name}"):
            await self.client.put(self.keys.ctl + name, value)

    async def control_changes(self, name: str) -> AsyncIterator[KeyValue | None]:
        """``ctl/<name>`` as the control view holds it now, then after each change of the
        view (the caller skips repeats)."""
        await self.usable()
        assert self.ctl is not None
        while True:
            seen = self.ctl.version
            yield self.ctl.kvs.get(self.keys.ctl + name)
            await self.ctl.wait_changed(seen)

    def notify_ctl(self) -> None:
        if self.ctl is not None:
            self.ctl.poke()  # waiters re-check this agent's own state

    def set_spare(self, spare: bool, **fields: Any) -> None:
        """A node beyond max_nodes is a spare: it waits for as long as the job runs
        (join_timeout is paused) and is admitted by the next round that has room."""
        if spare == self.spare:
            return
        self.spare = spare
        self.was_spare = self.was_spare or spare
        for deadline in self.deadlines:
            if spare:
                deadline.pause()
            elif self.client.reachability.unreachable_since is None:
                deadline.resume()
        if spare:
            logger.info("%s: waiting as a spare (%s)", self.config.label, self.progress)
            self.emit("spare_waiting", **fields)
        else:
            self.emit("spare_joining")

    @contextmanager
    def join_deadline(self) -> Iterator[anyio.CancelScope]:
        """A cancel scope of ``join_timeout`` that does not run while etcd is unreachable."""
        with anyio.CancelScope() as scope:
            deadline = PausableDeadline(scope, self.config.join_timeout)
            if self.client.reachability.unreachable_since is not None:
                deadline.pause()
            self.deadlines.add(deadline)
            try:
                yield scope
            finally:
                self.deadlines.discard(deadline)

    # the control view

    def state(self) -> State:
        assert self.ctl is not None
        return State(self.keys, self.ctl.kvs)

    async def wait(self, seen: int, until: float = math.inf) -> None:
        """Until the control view moves past version ``seen``, ``until`` (monotonic)
        passes or the rendezvous gave up."""
        assert self.ctl is not None
        failure: EtcdError | None = None
        with anyio.move_on_after(until - time.monotonic()):
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._cancel_on_give_up, tg.cancel_scope)
                try:
                    await self.ctl.wait_changed(seen)
                except EtcdError as exc:  # raised below, not wrapped in an ExceptionGroup
                    failure = exc
                tg.cancel_scope.cancel()
        if isinstance(failure, EtcdUnavailable):  # the watch waited out outage_limit
            self.lease.give_up(failure)
        elif failure is not None:
            raise failure
        self.check_usable()

    async def _cancel_on_give_up(self, scope: anyio.CancelScope) -> None:
        await self.lease.given_up.wait()
        scope.cancel()

    async def write(self, compares: list[JsonDict], success: list[JsonDict], *,
                    seen_in_view: bool = True) -> bool:
        """A guarded txn. On success wait until the view has its effect (the watch brings
        it: no re-read) unless it wrote outside ``ctl/``; on a conflict re-read the control
        keys once, so the next decision sees what changed."""
        assert self.ctl is not None
        result = await self.client.txn(compares, success)
        if not result.succeeded:
            await self.ctl.refresh()
        elif seen_in_view:
            with anyio.move_on_after(self.client.timeout):
                await self.ctl.wait_revision(result.revision)
        return result.succeeded

    async def put_held(self, key: str, value: str, guard: list[JsonDict], *,
                       seen_in_view: bool, restore_guard: list[JsonDict] | None = None
                       ) -> bool:
        """Put a lease-bound key of this agent, remembered (with the comparisons that must
        still hold then, default ``guard``) for restoring it after an outage."""
        lease = self.lease.id
        try:
            ok = await self.write(guard, [put_op(key, value, lease=lease)],
                                  seen_in_view=seen_in_view)
        except EtcdLeaseNotFound:  # expired across an outage, not replaced yet: now
            await self.lease.replace(lease)
            return False
        if ok:
            self.held[key] = (value, guard if restore_guard is None else restore_guard)
        return ok

    async def close(self, *, ok: bool, reason: str) -> None:
        """Close the job for every node (the first reason recorded wins)."""
        await self.client.txn(*close_job_txn(self.keys, ok=ok, reason=reason,
                                             node=self.node_id))

    @asynccontextmanager
    async def closing_on_bad_value(self) -> AsyncIterator[None]:
        """A value this node cannot read ends the job here: close it for the others too
        (best effort, bounded), so that none waits for this node until a timeout."""
        try:
            yield
        except BadValue as exc:
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.config.lease_ttl):
                try:
                    await self.close(ok=False, reason=str(exc))
                except EtcdError as error:
                    logger.warning("cannot close the job for the other nodes: %s", error)
            raise
