"""One etcd watch stream: a streaming ``POST /v3/watch`` to one member, read message by
message. ``watch.Watch`` keeps one or two of these open and decides when to leave a
member; this module only opens, reads and closes (see ``watch`` for the checks).

Opened with ``Grpc-Metadata-hasleader: true``: a member without a raft leader refuses it
at once (``etcdserver: no leader``) instead of accepting a watch it never feeds. TCP
keepalive on its socket breaks a connection whose far end vanished (etcd restarted while
the network was down) even when nothing is in flight.
"""

from __future__ import annotations

import json
import logging
import socket
import time

import aiohttp
import anyio

from supervisor.rendezvous.etcd.wire.client import (
    EtcdClient,
    EtcdCompacted,
    EtcdError,
    JsonDict,
    KeyValue,
    WatchEvent,
    _describe,
    _EndpointDown,
    _objects,
    _raise_for_error,
)

logger = logging.getLogger(__name__)

LEADER_HEADER = {"Grpc-Metadata-hasleader": "true"}
KEEPALIVE_PROBES = 3


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


class WatchStream:
    """One watch stream on one member at a time (``connect`` again to move it).

    ``endpoint`` is the member it is open on, or being opened on (None: neither);
    ``live`` says whether it is open."""

    def __init__(self, client: EtcdClient, key_range: JsonDict, keepalive: float) -> None:
        self._client = client
        self._key_range = key_range
        self._keepalive = keepalive
        self.endpoint: str | None = None
        self.connected_at: float | None = None  # monotonic; None: not open
        self._resp: aiohttp.ClientResponse | None = None
        self._buffer = b""
        self._first: list[WatchEvent] | None = None  # read while connecting, not yet read
        self._start_revision = 0

    @property
    def live(self) -> bool:
        return self.connected_at is not None

    def close(self) -> None:
        if self._resp is not None:
            self._resp.close()
            self._resp = None
        self._buffer, self._first = b"", None
        self.endpoint = self.connected_at = None

    async def connect(self, endpoint: str, start_revision: int) -> None:
        """Open the stream on ``endpoint`` from ``start_revision``; ``_EndpointDown`` if
        the member does not take it within the client's timeout (or refuses it)."""
        self.close()
        self.endpoint, self._start_revision = endpoint, start_revision
        body = {"create_request": {**self._key_range, "start_revision": str(start_revision),
                                   # server-driven progress notifications, where the
                                   # operator enabled them; nothing relies on them
                                   "progress_notify": True}}
        client = self._client
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=client.timeout)
        client.stats.watches_opened += 1
        try:
            with anyio.fail_after(client.timeout):
                headers = {**await client._headers(endpoint), **LEADER_HEADER}
                self._resp = await client._http().post(
                    endpoint + "/v3/watch", json=body, headers=headers, timeout=timeout)
                if self._resp.connection is not None \
                        and self._resp.connection.transport is not None:
                    set_keepalive(self._resp.connection.transport.get_extra_info("socket"),
                                  self._keepalive)
                # the first message says whether the member took it (a leaderless one
                # refuses)
                self._first = await self._read_message()
        except (aiohttp.ClientError, TimeoutError, _EndpointDown) as exc:
            self.close()
            raise _EndpointDown(_describe(exc)) from exc
        except BaseException:
            self.close()
            raise
        self.connected_at = time.monotonic()
        # a member that took a stream requiring a leader has one: it answers
        client.endpoint_health(endpoint).answered()

    async def read(self) -> list[WatchEvent]:
        """The next message's events (often none: a progress notification)."""
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await self._read_message()

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
        try:
            data = json.loads(await self._read_line())
        except (ValueError, RecursionError) as exc:
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
            raise EtcdCompacted(f"watch start revision {self._start_revision} was compacted "
                                f"(oldest kept: {compact})")
        reason = str(result.get("cancel_reason", "no reason given"))
        if "auth token" in reason:
            self._client._token = None
            raise _EndpointDown(reason)
        raise EtcdError(f"etcd canceled the watch: {reason}")
