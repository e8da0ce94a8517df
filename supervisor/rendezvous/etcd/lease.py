"""One agent's etcd lease, kept alive through outages of any length.

The keeper refreshes the lease every TTL/3. During an outage the refresh simply waits for
etcd (the client retries until its ``retry_window``, the rendezvous' ``outage_limit``, runs
out; None: for as long as the outage lasts), because membership cannot change while etcd is
unreachable and etcd renews every lease when a new leader is elected. When etcd answers
that the lease is gone, a new one is granted at once and ``on_expired`` is told whether
the loss happened across an outage (a cluster frozen as a whole expires every lease when
it wakes: the agent restores its keys and nothing changed) or while etcd was reachable
(someone revoked it, or this agent's refreshes were starved: the others saw it leave).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import anyio

from supervisor.rendezvous.etcd.wire.client import (
    EtcdClient,
    EtcdError,
    EtcdLeaseNotFound,
    EtcdUnavailable,
)

logger = logging.getLogger(__name__)

# The leave's revoke is asked of every member in rounds, a new round every REVOKE_EVERY s
# while no round has succeeded, each round's requests living up to REVOKE_ATTEMPT s: a
# member electing a leader never answers a request made before the election (etcd dropped
# the proposal), so the first round made after a leader exists is the one that commits
# (within REVOKE_EVERY of the election), and a slow link's answer (hundreds of
# milliseconds) still comes. At most REVOKE_ATTEMPT / REVOKE_EVERY rounds are in flight.
REVOKE_EVERY = 0.1
REVOKE_ATTEMPT = 1.0

ExpiredHook = Callable[[bool], Awaitable[None]]  # (lost across an outage?) -> restore keys


class LeaseKeeper:
    """This agent's lease: ``id`` changes when an expired lease is replaced."""

    def __init__(self, client: EtcdClient, ttl: int, on_expired: ExpiredHook, *,
                 service: str = "etcd") -> None:
        self._client = client
        self._service = service  # what messages call etcd (c10d: the rendezvous host)
        self._lease = "etcd lease" if service == "etcd" else "rendezvous lease"
        self.id = 0
        self.ttl = ttl
        self.generation = 0  # leases granted so far
        self.given_up = anyio.Event()  # etcd stayed unreachable longer than the limit
        self.given_up_reason = ""
        self._on_expired = on_expired
        self._stopped = anyio.Event()
        self._last_ok = 0.0
        self._replacing = anyio.Lock()

    @property
    def last_refresh_sent(self) -> float:
        """When the last grant or refresh that etcd answered was sent (monotonic)."""
        return self._last_ok

    async def grant(self, *, bounded: bool = False) -> None:
        """A new lease; ``bounded``: retry for one TTL at most (start-up: a bad endpoint
        must fail quickly, not wait out an outage)."""
        sent = time.monotonic()
        if bounded:
            self.id, self.ttl = await self._client.lease_grant(self.ttl, retry_window=self.ttl)
        else:
            self.id, self.ttl = await self._client.lease_grant(self.ttl)
        self.generation += 1
        self._last_ok = sent
        logger.info("%s %x granted (ttl %ds)", self._lease, self.id, self.ttl)

    async def keep_alive(self) -> None:
        """Refresh until stopped or given up; replace the lease when etcd says it expired."""
        while True:
            with anyio.move_on_after(self.ttl / 3):
                await self._stopped.wait()
            if self._stopped.is_set():
                return
            sent, lease = time.monotonic(), self.id
            try:
                await self._client.lease_keepalive(lease)
            except EtcdLeaseNotFound:
                await self.replace(lease)
                continue
            except EtcdUnavailable as exc:  # only with a finite outage_limit
                if not self._stopped.is_set():
                    self.give_up(exc)
                return
            except EtcdError as exc:
                if self._stopped.is_set():
                    return
                logger.warning("%s keepalive failed, retrying: %s", self._lease, exc)
                continue
            self._last_ok = sent

    def lost_across_outage(self) -> bool:
        """Whether etcd was unreachable since the last refresh that worked, or came back
        within two TTLs (a frozen cluster may renew once more on waking, then expire)."""
        r = self._client.reachability
        now = time.monotonic()
        if r.unreachable_since is not None:
            return True
        if r.last_failure_at is not None and r.last_failure_at >= self._last_ok:
            return True
        return r.recovered_at is not None and now - r.recovered_at <= 2 * self.ttl

    async def replace(self, expired: int) -> None:
        """etcd said lease ``expired`` is gone (to the keepalive, or to a write that used
        it): grant a new one, once, whoever noticed first."""
        async with self._replacing:
            if self.id == expired and not self._stopped.is_set():
                await self._replace()

    async def _replace(self) -> None:
        across = self.lost_across_outage()
        old = self.id
        while not self._stopped.is_set():
            try:
                await self.grant()
                break
            except EtcdUnavailable as exc:
                return self.give_up(exc)
            except EtcdError as exc:
                logger.warning("cannot replace the expired %s, retrying: %s", self._lease, exc)
                await anyio.sleep(min(self.ttl / 10, 0.5))
        logger.warning("%s %x expired %s; new lease %x", self._lease, old,
                       f"during the {self._service} outage" if across
                       else f"while {self._service} was reachable",
                       self.id)
        await self._on_expired(across)

    def give_up(self, exc: EtcdError) -> None:
        """etcd stayed unreachable longer than ``outage_limit``: the rendezvous is over."""
        if self.given_up.is_set():
            return
        limit = self._client.retry_window
        bound = "none" if limit is None else f"{limit:g}s"
        self.given_up_reason = (f"{self._service} unreachable for longer than outage_limit "
                                f"({bound}): {exc}")
        # not an error line of its own: the rendezvous raises it, and the run ends saying so
        logger.info("rendezvous gives up: %s", self.given_up_reason)
        self.given_up.set()

    async def revoke(self) -> None:
        """Stop refreshing and revoke, so this node's keys vanish now (best effort). The
        revoke goes to every member at once (a member cut off without an error must not
        delay the leave), in overlapping rounds (``REVOKE_EVERY``) until one succeeds or
        the lease would have expired anyway; the caller bounds the wait. A lease already
        gone (revoked through another member first, or expired) counts as revoked."""
        self._stopped.set()
        if not self.id or self.given_up.is_set():
            return
        body = {"ID": str(self.id)}
        ended = anyio.Event()
        refused: EtcdError | None = None  # the refusal that ended it, if one did
        unanswered: EtcdUnavailable | None = None  # the last round no member answered

        async def one_round() -> None:
            nonlocal refused, unanswered
            try:
                await self._client.call(
                    "/v3/lease/revoke", body, retry_window=0, hedge_after=0.0,
                    attempt_timeout=min(REVOKE_ATTEMPT, self._client.timeout))
            except EtcdLeaseNotFound:
                pass
            except EtcdUnavailable as exc:
                unanswered = exc
                return  # a later round asks again
            except EtcdError as exc:  # refused (not electing): asking again changes nothing
                refused = refused or exc
            ended.set()

        with anyio.move_on_after(self.ttl):
            async with anyio.create_task_group() as tg:
                while not ended.is_set():
                    tg.start_soon(one_round)
                    with anyio.move_on_after(REVOKE_EVERY):
                        await ended.wait()
                tg.cancel_scope.cancel()
        failure = refused if ended.is_set() else unanswered or "no etcd member answered"
        if failure is not None:
            logger.warning("could not revoke %s (it expires in %ds): %s", self._lease, self.ttl,
                           failure)


class PausableDeadline:
    """A cancel scope's deadline that stops running while etcd is unreachable: a join
    timeout must not expire during an outage (``outage_limit`` bounds that instead)."""

    def __init__(self, scope: anyio.CancelScope, seconds: float) -> None:
        self.scope = scope
        self._remaining = seconds
        scope.deadline = anyio.current_time() + seconds

    def pause(self) -> None:
        if self.scope.deadline != float("inf"):
            self._remaining = max(self.scope.deadline - anyio.current_time(), 0.0)
            self.scope.deadline = float("inf")

    def resume(self) -> None:
        if self.scope.deadline == float("inf"):
            self.scope.deadline = anyio.current_time() + self._remaining
