"""etcd watches that cannot go blind, and the prefix views built on them.

A watch is one streaming ``POST /v3/watch`` to one member through etcd's JSON gateway.
Left alone, such a stream says nothing when its member is cut off, has lost its raft
leader, or was restarted while the network was down (the old connection is then dead on
etcd's side only): it simply stays silent. Three things keep it honest (measured against
etcd 3.4, see docs/rendezvous.md, "Watches that cannot go blind"):

- **The leader requirement.** The stream is opened with ``Grpc-Metadata-hasleader: true``,
  so a member without a leader refuses it at once (``etcdserver: no leader``, ~15 ms)
  instead of accepting a watch it will never feed.
- **It follows the requests.** Every ``check_interval`` (the client's request timeout) the
  watch looks at what the client learnt about its member: when the client's requests
  moved to another member (the preferred endpoint changed) or the latest request to this
  member failed, the watch moves too. When no request reached its member for a whole
  two intervals, it asks the member itself (``EtcdClient.probe``: a linearizable read, which
  needs the member's leader and quorum). A member that does not answer in time is left.
- **TCP keepalive** on the stream's socket (idle = the interval, 3 probes): a connection
  whose far end vanished (etcd restarted during a cut, a middlebox forgot it) breaks
  within about two intervals even when no request is in flight.

A watch that moves resumes from the last revision it delivered + 1, so no event is lost
or repeated. After an outage (no member answered for a while) a watch asks its owner to
re-read (``WatchResync``): a ``PrefixView`` then reads the whole prefix again and re-opens
its watch from the fresh revision, so nothing it decides on predates the outage.
The gateway's WebSocket transport would allow progress requests on the stream, but it
forwards neither the leader header nor the ``Authorization`` header (etcd 3.4's
grpc-websocket-proxy): so the stream stays a plain POST.
"""

from __future__ import annotations

import supervisor.lean  # noqa: F401  -- before the first aiohttp import

# isort: split
import base64
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Literal

import aiohttp
import anyio

from supervisor.rendezvous.etcd_client import (
    EtcdClient,
    EtcdCompacted,
    EtcdError,
    EtcdUnavailable,
    JsonDict,
    KeyValue,
    WatchEvent,
    _describe,
    _EndpointDown,
    _key_range,
    _objects,
    _raise_for_error,
)

logger = logging.getLogger(__name__)

LEADER_HEADER = {"Grpc-Metadata-hasleader": "true"}
KEEPALIVE_PROBES = 3


LiveHook = Callable[[bool], None]  # the stream went live (True) or dead (False)


class WatchResync(EtcdError):
    """etcd was unreachable since the watch last delivered: re-read before trusting it."""


class _Quiet(Exception):
    """The watch's member stopped answering or the client's requests moved elsewhere."""


def set_keepalive(sock: socket.socket | None, interval: float) -> None:
    """TCP keepalive on ``sock``: probes after ``interval`` idle seconds, then every
    ``interval/3``, given up after ``KEEPALIVE_PROBES``; unacknowledged data also times out
    after two intervals. Where an option is missing (not Linux), what exists is set."""
    if sock is None:
        return
    idle, every = max(1, round(interval)), max(1, round(interval / 3))
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", every),
                        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
                        ("TCP_USER_TIMEOUT", int(2 * interval * 1000))):
        if hasattr(socket, name):
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    for level, option, value in options:
        try:
            sock.setsockopt(level, option, value)
        except OSError as exc:  # a socket type without it: the other checks still hold
            logger.debug("setsockopt(%s, %s) failed: %s", level, option, exc)


class Watch:
    """One watch stream; yields batches of events, reconnecting across endpoints.

    ``check_interval`` (default: the client's request timeout) is how often the watch
    checks that its member still answers (see the module docstring)."""

    def __init__(self, client: EtcdClient, key_range: JsonDict, start_revision: int, *,
                 check_interval: float | None = None,
                 on_live: LiveHook | None = None) -> None:
        self._client = client
        self._on_live = on_live
        self._key_range = key_range
        self._probe_key = base64.b64decode(key_range["key"]).decode()
        self.next_revision = start_revision
        self.check_interval = check_interval or client.timeout
        self.endpoint: str | None = None  # the member the stream is open on
        self.connected_at: float | None = None  # monotonic; None: not connected
        self.moves = 0  # times the stream left a member that went quiet
        self._outages_seen = client.reachability.outages
        self._resp: aiohttp.ClientResponse | None = None
        self._buffer = b""
        self._first: list[WatchEvent] | None = None  # read while connecting, not delivered

    async def __aenter__(self) -> Watch:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._disconnect()

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> list[WatchEvent]:
        while True:
            if self._resp is None:
                await self._connect_with_retries()
                self._check_outage()
            try:
                events = await self._read_checked()
            except _EndpointDown as exc:
                logger.info("etcd watch stream on %s broke (%s); reconnecting",
                            self.endpoint, exc)
                self._disconnect()
                continue
            except _Quiet as exc:
                logger.warning("etcd watch leaves %s: %s", self.endpoint, exc)
                self.moves += 1
                self._disconnect()
                continue
            if events:
                self._client.stats.watch_events += len(events)
                self._client.stats.watch_bytes += sum(len(ev.kv.value) for ev in events)
                self.next_revision = events[-1].kv.mod_revision + 1
                return events

    @property
    def live(self) -> bool:
        """Whether a stream is open on a member that answers (as far as the checks know)."""
        return self._resp is not None

    def _check_outage(self) -> None:
        """An outage came and went since the stream last delivered: the owner must re-read
        (the keys may have changed in ways a resumed stream would only replay slowly, and
        a lease expired meanwhile changes what this agent may write)."""
        outages = self._client.reachability.outages
        if outages != self._outages_seen:
            self._outages_seen = outages
            raise WatchResync("etcd was unreachable since this watch last delivered")

    def _disconnect(self) -> None:
        if self._resp is not None:
            self._resp.close()
            self._resp = None
            self._buffer = b""
            if self.connected_at is not None and self._on_live is not None:
                self._on_live(False)
        self.connected_at = None

    async def _read_checked(self) -> list[WatchEvent]:
        """The next message, checking the member every ``check_interval`` meanwhile."""
        while True:
            with anyio.move_on_after(self.check_interval):
                return await self._read_message()
            self._check_outage()
            await self._check_member()

    async def _check_member(self) -> None:
        """Raise ``_Quiet`` if this stream's member should be left (module docstring)."""
        client, endpoint = self._client, self.endpoint
        assert endpoint is not None
        health = client.endpoint_health(endpoint)
        if client.preferred != endpoint and not client.endpoint_health(client.preferred).failing:
            raise _Quiet(f"requests moved to {client.preferred}")
        if health.failing:
            raise _Quiet("its latest request failed")
        # the lease keepalive (every TTL/3) usually answers for the member: probe only
        # when nothing did for two intervals
        if time.monotonic() - health.last_ok > 2 * self.check_interval:
            try:
                await client.probe(endpoint, self._probe_key)
            except EtcdUnavailable as exc:
                client._avoid(endpoint)
                raise _Quiet(f"it did not answer a read in {client.timeout:g}s ({exc})") from exc

    async def _connect_with_retries(self) -> None:
        client, delay = self._client, 0.05
        window = client.retry_window
        if window is not None:
            window = max(window, client.timeout)
        while True:
            failures: list[str] = []
            for endpoint in client._rotation():
                try:
                    await self._connect(endpoint)
                except _EndpointDown as exc:
                    failures.append(f"{endpoint}: {exc}")
                    client.endpoint_health(endpoint).failed()
                    client._avoid(endpoint)
                    continue
                client._prefer(endpoint)
                return
            # A watch that connects proves little, so only failures count towards the
            # outage; the next unary answer ends it.
            client._unreached("; ".join(failures))
            remaining = client._may_retry(window)
            if remaining <= 0:
                age = client.reachability.outage_age(time.monotonic())
                raise EtcdUnavailable(f"etcd watch could not reconnect for {age:.1f}s "
                                      f"({'; '.join(failures)})")
            await anyio.sleep(min(delay, remaining))  # every member is down: back off
            delay = min(delay * 2, 1.0)

    async def _connect(self, endpoint: str) -> None:
        body = {"create_request": {**self._key_range, "start_revision": str(self.next_revision),
                                   # server-driven progress notifications, where the
                                   # operator enabled them; nothing relies on them
                                   "progress_notify": True}}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._client.timeout)
        headers = {**await self._client._headers(endpoint), **LEADER_HEADER}
        self._client.stats.watches_opened += 1
        try:
            with anyio.fail_after(self._client.timeout):
                resp = await self._client._http().post(
                    endpoint + "/v3/watch", json=body, headers=headers, timeout=timeout)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _EndpointDown(_describe(exc)) from exc
        if resp.connection is not None and resp.connection.transport is not None:
            set_keepalive(resp.connection.transport.get_extra_info("socket"),
                          self.check_interval)
        self._resp, self.endpoint = resp, endpoint
        try:  # the first message says whether the member took it (a leaderless one refuses)
            with anyio.fail_after(self._client.timeout):
                self._first = await self._read_message()
        except (_EndpointDown, TimeoutError) as exc:
            self._disconnect()
            raise _EndpointDown(_describe(exc)) from exc
        except BaseException:
            self._disconnect()
            raise
        self.connected_at = time.monotonic()
        # a member that took a stream requiring a leader has one: it answers
        self._client.endpoint_health(endpoint).answered()
        if self._on_live is not None:
            self._on_live(True)

    async def _read_line(self) -> bytes:
        assert self._resp is not None
        while b"\n" not in self._buffer:
            try:
                chunk = await self._resp.content.readany()
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                raise _EndpointDown(_describe(exc)) from exc
            if not chunk:
                if self._buffer.strip():  # a last message without its newline (an error)
                    line, self._buffer = self._buffer, b""
                    return line
                raise _EndpointDown("stream closed")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    async def _read_message(self) -> list[WatchEvent]:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        try:
            data = json.loads(await self._read_line())
        except ValueError as exc:
            raise EtcdError("etcd watch sent something that is not JSON") from exc
        _raise_for_error(data)
        result: JsonDict = data.get("result", {})
        if result.get("canceled"):
            self._raise_canceled(result)
        return [
            WatchEvent("DELETE" if ev.get("type") == "DELETE" else "PUT",
                       KeyValue.from_json(ev.get("kv")))
            for ev in _objects(result.get("events", ()))
        ]

    def _raise_canceled(self, result: JsonDict) -> None:
        compact = int(result.get("compact_revision", 0))
        if compact:
            raise EtcdCompacted(f"watch start revision {self.next_revision} was compacted "
                                f"(oldest kept: {compact})")
        reason = str(result.get("cancel_reason", "no reason given"))
        if "auth token" in reason:
            self._client._token = None
            raise _EndpointDown(reason)
        raise EtcdError(f"etcd canceled the watch: {reason}")


def _prefix_range(prefix: str) -> JsonDict:
    return _key_range(prefix, True)


class PrefixView:
    """A local copy of every key under a prefix, kept current by one watch.

    Open with :func:`open_prefix_view`. ``kvs`` maps full keys to values as of
    ``revision``; :meth:`wait_changed` returns after an update. After an outage the view
    reads the prefix again and re-opens its watch from that fresh revision.
    """

    def __init__(self, client: EtcdClient, prefix: str, *,
                 on_live: LiveHook | None = None) -> None:
        self.client = client
        self.prefix = prefix
        self._on_live = on_live
        self.kvs: dict[str, KeyValue] = {}
        self.revision = 0
        self.version = 0  # bumped on every update; pass it to wait_changed
        self.resyncs = 0  # re-reads after an outage
        self._changed = anyio.Event()
        self._error: EtcdError | None = None
        self._watch: Watch | None = None

    @property
    def watch_live(self) -> bool:
        """Whether the view's watch stream is open on a member that answers."""
        return self._watch is not None and self._watch.live

    @property
    def watch_endpoint(self) -> str | None:
        return self._watch.endpoint if self._watch is not None else None

    async def refresh(self, *, retry_window: float | Literal["default"] | None = "default"
                      ) -> None:
        """Re-read the whole prefix now (after a write, so decisions see its effect)."""
        result = await self.client.range(self.prefix, prefix=True, retry_window=retry_window)
        if result.revision > self.revision:
            self.kvs = {kv.key: kv for kv in result.kvs}
            self.revision = result.revision
            self._notify()

    async def wait_changed(self, since: int | None = None) -> None:
        """Wait until ``version`` moves past ``since`` (default: now); raise the watch's
        error if it failed for good. Read ``version`` with the state you decided on, so an
        update in between is not missed."""
        since = self.version if since is None else since
        while self.version <= since and self._error is None:
            await self._changed.wait()
        if self._error is not None:
            raise self._error

    async def wait_revision(self, revision: int) -> None:
        """Wait until the view has applied ``revision`` (a write of ours under the prefix):
        the watch brings it, so no re-read is needed."""
        while self.revision < revision and self._error is None:
            await self._changed.wait()
        if self._error is not None:
            raise self._error

    def poke(self) -> None:
        """Wake every ``wait_changed`` as if the prefix had changed: its owner's own state
        did (for example its lease was replaced), so waiters should look again."""
        self._notify()

    def _notify(self) -> None:
        self.version += 1
        self._changed.set()
        self._changed = anyio.Event()

    def _apply(self, events: list[WatchEvent]) -> None:
        # One txn's events share a revision: filter against the revision before the batch.
        floor = self.revision
        fresh = [ev for ev in events if ev.kv.mod_revision > floor]
        for ev in fresh:
            if ev.type == "DELETE":
                self.kvs.pop(ev.kv.key, None)
            else:
                self.kvs[ev.kv.key] = ev.kv
            self.revision = ev.kv.mod_revision
        if fresh:
            self._notify()

    async def _resync(self, why: str) -> None:
        """Read everything again, from a fresh revision (after an outage, or when the
        watch's start revision was compacted away)."""
        result = await self.client.range(self.prefix, prefix=True)
        self.kvs = {kv.key: kv for kv in result.kvs}
        self.revision = max(self.revision, result.revision)
        self.resyncs += 1
        logger.info("etcd %s re-read %s at revision %d (%d key(s))",
                    self.prefix, why, self.revision, len(self.kvs))
        self._notify()

    async def _follow(self) -> None:
        reread = ""
        while True:
            try:
                if reread:  # inside the try: a re-read that fails ends the view like a watch
                    await self._resync(reread)
                    reread = ""
                async with Watch(self.client, _prefix_range(self.prefix), self.revision + 1,
                                 on_live=self._on_live) as watch:
                    self._watch = watch
                    async for events in watch:
                        self._apply(events)
            except WatchResync:
                reread = "after the outage"
            except EtcdCompacted:
                reread = "after its history was compacted"
            except EtcdError as exc:
                self._error = exc
                self._notify()
                return
            finally:
                self._watch = None


@asynccontextmanager
async def open_prefix_view(client: EtcdClient, prefix: str, *,
                           retry_window: float | Literal["default"] | None = "default",
                           on_live: LiveHook | None = None,
                           ) -> AsyncIterator[PrefixView]:
    """Read ``prefix`` (retrying for ``retry_window``) and follow it by watch until the
    block exits; ``on_live`` hears the watch stream go live and dead."""
    view = PrefixView(client, prefix, on_live=on_live)
    await view.refresh(retry_window=retry_window)
    body_error: BaseException | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(view._follow)
        try:
            yield view
        except BaseException as exc:  # re-raised below, not wrapped in an ExceptionGroup
            body_error = exc
        finally:
            tg.cancel_scope.cancel()
    if body_error is not None:
        raise body_error
