"""A small async etcd v3 client over etcd's JSON gRPC gateway, using aiohttp.

Why not gRPC: grpcio's fork handlers crash children that the supervisor spawns (DESIGN 5),
and the gateway (``/v3/kv/...``, ``/v3/lease/...``, ``/v3/watch``) needs no new dependency.
Keys and values are base64 in the gateway's JSON and int64 fields arrive as strings.

Every attempt is bounded by ``timeout``; a connection failure (or an "unavailable" answer)
moves on to the next endpoint, and when every endpoint failed the client retries with
backoff until the outage is ``retry_window`` seconds old (0: one pass; None: for as long as
it lasts) before raising ``EtcdUnavailable``. An outage starts with the first pass in which
no endpoint answered and ends with the next answer, whichever call gets it; ``reachability``
says where it stands and ``on_reachability`` hears each change. The client then sticks to
the endpoint that answered. With ``hedge_after`` set, a member that has not answered a
call within that many seconds does not hold it up: the next member is asked as well and
the first answer wins (a member isolated without an error otherwise costs a whole
``timeout`` per call until a failure moves the client on). ``stats`` counts requests, txn
conflicts, retries and watch events (for the scale benchmark and the cost model).
Passwords and tokens are never logged.
"""

from __future__ import annotations

import base64
import logging
import os
import ssl
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, Protocol

import aiohttp
import anyio

from supervisor.rendezvous.etcd.wire.decode import WireError, gateway_kv, gateway_list

logger = logging.getLogger(__name__)

JsonDict = dict[str, Any]
# gRPC codes that mean "this member cannot answer now: ask another one": DEADLINE_EXCEEDED,
# UNAVAILABLE, and CANCELLED, which a gracefully stopping member's gateway sends on open
# watch streams ("grpc: the client connection is closing").
_RETRY_ELSEWHERE = frozenset({1, 4, 14})
# UNKNOWN (2) or INTERNAL (13) with the gateway's own transport errors: the member's gRPC
# server went away under its gateway (a member stopping gracefully answers "OK: HTTP
# status code 200; transport: missing content-type field", code 2, or "server closed the
# stream without sending trailers", code 13), not an answer of etcd's: ask another member
_GATEWAY_CODES = frozenset({2, 13})
_GATEWAY_TRANSPORT = ("transport:", "without sending trailers", "connection is closing")
_UNAUTHENTICATED = 16
_OPS = {"=": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}
# The agents' hedge: a member silent for this long no longer holds a request up, the next
# one is asked too (a member isolated without an error would otherwise cost a whole
# request timeout: of the leave's revoke, of the leader's txn that makes the others see a
# change). A healthy member answers in milliseconds; a duplicate costs one request,
# guarded like any retry.
HEDGE_AFTER = 0.2


def hedge_delay(timeout: float) -> float:
    """The agents' ``hedge_after`` for a client with this request ``timeout``."""
    return min(HEDGE_AFTER, timeout / 4)


class EtcdError(Exception):
    """etcd refused a request or answered something this client does not understand."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class EtcdUnavailable(EtcdError):
    """No endpoint answered (connection refused, timeout, no leader)."""


class EtcdLeaseNotFound(EtcdError):
    """The lease expired or was revoked."""


class EtcdCompacted(EtcdError):
    """A watch asked for history that etcd has compacted away."""


class SslSource(Protocol):
    """What the client needs of its TLS settings (``TlsFiles``)."""

    def ssl_context(self) -> ssl.SSLContext: ...


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for TLS: a CA to verify etcd, and an optional client certificate."""

    cacert: str | None = None
    cert: str | None = None
    key: str | None = None

    def ssl_context(self) -> ssl.SSLContext:
        """An ``SSLContext`` verifying the server against ``cacert`` (or system CAs)."""
        context = ssl.create_default_context(cafile=self.cacert)
        if self.cert:
            context.load_cert_chain(self.cert, self.key)
        return context


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd stores it."""

    key: str
    value: bytes
    create_revision: int = 0
    mod_revision: int = 0
    version: int = 0
    lease: int = 0

    @property
    def text(self) -> str:
        return self.value.decode()

    @classmethod
    def from_json(cls, data: object) -> KeyValue:
        """One key of the gateway's JSON, checked by ``decode.gateway_kv``; ``EtcdError``
        if it is not one."""
        try:
            return cls(*gateway_kv(data))
        except WireError as exc:
            raise EtcdError(f"etcd answered {exc}") from None


@dataclass(frozen=True)
class WatchEvent:
    type: Literal["PUT", "DELETE"]
    kv: KeyValue


@dataclass(frozen=True)
class RangeResult:
    kvs: tuple[KeyValue, ...]
    revision: int


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int
    responses: tuple[JsonDict, ...]


@dataclass
class EtcdStats:
    """What one client sent and received (monotonic counts, never reset)."""

    requests: int = 0  # HTTP requests sent, retries included (watch streams excluded)
    failed_attempts: int = 0  # requests to one endpoint that failed (down, timeout)
    retry_passes: int = 0  # passes over every endpoint that all failed (then backoff)
    txns: int = 0
    txn_conflicts: int = 0  # txns whose comparisons did not hold
    watches_opened: int = 0  # watch streams opened, reconnects included
    watch_events: int = 0  # events delivered by every watch (each once)
    watch_duplicates: int = 0  # events a watch's second stream brought again (dropped)
    watch_bytes: int = 0  # bytes of the values those events carried
    by_path: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, int]:
        flat = {k: v for k, v in vars(self).items() if isinstance(v, int)}
        flat.update({f"path:{p}": n for p, n in self.by_path.items()})
        return flat


@dataclass
class Reachability:
    """Whether etcd answers, as this client last found out (monotonic times)."""

    unreachable_since: float | None = None  # the current outage began (None: reachable)
    cause: str = ""  # why the last pass failed, when unreachable
    outages: int = 0  # outages so far (a pass in which no endpoint answered)
    last_outage: float = 0.0  # seconds the last finished outage lasted
    total_outage: float = 0.0  # seconds unreachable over all finished outages
    recovered_at: float | None = None  # when the last outage ended
    last_failure_at: float | None = None  # the last pass in which no endpoint answered
    answered_at: float | None = None  # the last answer of any call

    def outage_age(self, now: float) -> float:
        """Seconds the current outage has lasted (0 when reachable)."""
        return 0.0 if self.unreachable_since is None else now - self.unreachable_since


ReachabilityHook = Callable[[bool, Reachability], None]  # (reachable now?, state)


@dataclass
class EndpointHealth:
    """One member as this client last found it (monotonic times; 0: never)."""

    last_ok: float = 0.0  # it answered a request
    last_failed: float = 0.0  # a request to it failed (down, timeout, no leader)

    def answered(self) -> None:
        self.last_ok = time.monotonic()

    def failed(self) -> None:
        self.last_failed = time.monotonic()

    @property
    def failing(self) -> bool:
        """Whether its latest request failed."""
        return self.last_failed > self.last_ok


def _b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode()


def _objects(items: object) -> list[JsonDict]:
    try:
        return gateway_list(items)
    except WireError as exc:
        raise EtcdError(f"etcd answered {exc}") from None


def prefix_end(prefix: str) -> str:
    """The ``range_end`` that selects every key starting with ``prefix`` (ASCII prefixes)."""
    if not prefix:
        return "\0"
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def _key_range(key: str, prefix: bool, revision: int = 0) -> JsonDict:
    body: JsonDict = {"key": _b64(key)}
    if prefix:
        body["range_end"] = _b64(prefix_end(key))
    if revision > 0:
        body["revision"] = revision
    return body


def compare(key: str, target: str, op: str, value: int | str, *, prefix: bool = False) -> JsonDict:
    """A txn comparison. ``target`` is VERSION, CREATE, MOD, VALUE or LEASE; ``op`` one of
    ``= != < >``. A missing key compares as version/create/mod 0. With ``prefix`` every key
    under ``key`` must satisfy it."""
    fields = {"VERSION": "version", "CREATE": "create_revision", "MOD": "mod_revision",
              "VALUE": "value", "LEASE": "lease"}
    body = _key_range(key, prefix)
    body.update(target=target, result=_OPS[op])
    body[fields[target]] = _b64(str(value)) if target == "VALUE" else str(value)
    return body


def put_op(key: str, value: str | bytes, *, lease: int = 0) -> JsonDict:
    return {"request_put": {"key": _b64(key), "value": _b64(value), "lease": str(lease)}}


def delete_op(key: str, *, prefix: bool = False) -> JsonDict:
    return {"request_delete_range": _key_range(key, prefix)}


def range_op(key: str, *, prefix: bool = False) -> JsonDict:
    return {"request_range": _key_range(key, prefix)}


class _EndpointDown(Exception):
    """This endpoint failed in a way another endpoint may not (connection, timeout)."""


def _raise_for_error(data: JsonDict) -> None:
    error = data.get("error")
    if error is None:
        return
    if isinstance(error, dict):  # streaming endpoints nest it: {"error": {"grpc_code": ...}}
        code, message = error.get("grpc_code"), str(error.get("message", error))
    else:
        code, message = data.get("code"), str(data.get("message", error))
    code = int(code) if code is not None else None
    if code in _RETRY_ELSEWHERE or (
            code in _GATEWAY_CODES and any(m in message for m in _GATEWAY_TRANSPORT)):
        raise _EndpointDown(message)
    if "lease not found" in message:
        raise EtcdLeaseNotFound(message, code)
    raise EtcdError(message, code)


MAX_CAUSE = 200  # characters of one attempt's error kept in messages


def _describe(exc: BaseException) -> str:
    """One attempt's error, short: a refused or unreachable connection in the kernel's
    words (aiohttp's own text repeats the address and more), anything else bounded."""
    code = exc.os_error.errno if isinstance(exc, aiohttp.ClientConnectorError) else None
    if type(exc) is aiohttp.ClientConnectorError and code is not None and code > 0:
        return os.strerror(code).lower()  # not a name that did not resolve (waitreport)
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return text if len(text) <= MAX_CAUSE else text[:MAX_CAUSE - 3] + "..."


class EtcdClient:
    """An etcd v3 client over the JSON gateway with endpoint failover.

    Use as ``async with EtcdClient([...]) as client:``; the HTTP session opens lazily and
    ``aclose()`` releases it.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout: float = 5.0,
        tls: SslSource | None = None,
        user: str | None = None,
        password: str | None = None,
        retry_window: float | None = 0.0,
        on_reachability: ReachabilityHook | None = None,
        hedge_after: float | None = None,
        service: str = "etcd",
    ) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is required")
        self.endpoints = tuple(e.rstrip("/") for e in endpoints)
        self.timeout = timeout
        self.retry_window = retry_window
        self.hedge_after = hedge_after
        self.service = service  # what its errors call the server (c10d: the rendezvous host)
        self.stats = EtcdStats()
        self.reachability = Reachability()
        self.on_reachability = on_reachability
        self._tls = tls
        self._user = user
        self._password = password
        self._token: str | None = None
        self._current = 0
        self._health: dict[str, EndpointHealth] = {}
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"EtcdClient(endpoints={self.endpoints!r}, user={self._user!r})"

    async def __aenter__(self) -> EtcdClient:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP session; later calls raise ``EtcdError``."""
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._closed:
            raise EtcdError("etcd client is closed")
        if self._session is None:
            try:
                ssl_arg: ssl.SSLContext | bool = self._tls.ssl_context() if self._tls else True
            except (OSError, ssl.SSLError) as exc:
                raise EtcdError(f"cannot load the etcd TLS files: {exc}") from exc
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ssl_arg))
        return self._session

    def _rotation(self) -> Iterator[str]:
        """Every endpoint once, starting with the preferred one."""
        start = self._current
        for i in range(len(self.endpoints)):
            yield self.endpoints[(start + i) % len(self.endpoints)]

    def _prefer(self, endpoint: str) -> None:
        self._current = self.endpoints.index(endpoint)

    def _avoid(self, endpoint: str) -> None:
        """Start the next call after ``endpoint``: a member that just failed (say, a follower
        holding requests until a new leader is elected) should not delay every call."""
        if self.endpoints[self._current] == endpoint:
            self._current = (self._current + 1) % len(self.endpoints)

    async def _headers(self, endpoint: str) -> dict[str, str]:
        if self._user is None:
            return {}
        if self._token is None:
            body = {"name": self._user, "password": self._password or ""}
            data = await self._post_once(endpoint, "/v3/auth/authenticate", body, {})
            self._token = str(data["token"])
        return {"Authorization": self._token}

    def _reached(self) -> None:
        """An endpoint answered: end the outage, if there was one."""
        r = self.reachability
        now = time.monotonic()
        r.answered_at = now
        if r.unreachable_since is None:
            return
        r.last_outage = now - r.unreachable_since
        r.total_outage += r.last_outage
        r.unreachable_since, r.recovered_at, r.cause = None, now, ""
        if self.on_reachability is not None:
            self.on_reachability(True, r)

    def _unreached(self, cause: str, began: float) -> None:
        """A whole pass, begun at ``began``, failed: start (or extend) the outage. Not when
        another call got an answer after that pass began: its failures are older news than
        that answer (a pass that waited out a member without a leader while the members
        that had been down came back), and one outage would be reported as two."""
        r = self.reachability
        now = time.monotonic()
        r.cause, r.last_failure_at = cause, now
        self.stats.retry_passes += 1
        if r.unreachable_since is not None:
            return
        if r.answered_at is not None and r.answered_at > began:
            return
        r.unreachable_since = now
        r.outages += 1
        if self.on_reachability is not None:
            self.on_reachability(False, r)

    def _may_retry(self, window: float | None) -> float:
        """Seconds the current outage may still last before calls give up (inf: no bound)."""
        if window is None:
            return float("inf")
        return window - self.reachability.outage_age(time.monotonic())

    async def _post_once(
        self, endpoint: str, path: str, body: JsonDict, headers: dict[str, str]
    ) -> JsonDict:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        self.stats.requests += 1
        self.stats.by_path[path] += 1
        try:
            async with self._http().post(
                endpoint + path, json=body, headers=headers, timeout=timeout
            ) as resp:
                data = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _EndpointDown(_describe(exc)) from exc
        except ValueError as exc:
            raise EtcdError(f"{endpoint}{path} answered something that is not JSON") from exc
        if not isinstance(data, dict):
            raise EtcdError(f"{endpoint}{path} answered unexpected JSON")
        _raise_for_error(data)
        return data

    async def _post_authenticated(self, endpoint: str, path: str, body: JsonDict) -> JsonDict:
        try:
            return await self._post_once(endpoint, path, body, await self._headers(endpoint))
        except EtcdError as exc:
            if exc.code != _UNAUTHENTICATED or self._user is None:
                raise
        self._token = None  # expired or issued by another member: authenticate again, once
        return await self._post_once(endpoint, path, body, await self._headers(endpoint))

    async def call(self, path: str, body: JsonDict, *,
                   retry_window: float | Literal["default"] | None = "default",
                   hedge_after: float | Literal["default"] | None = "default",
                   attempt_timeout: float | None = None) -> JsonDict:
        """POST ``body`` to ``path`` on the first endpoint that answers; the raw JSON reply.
        ``retry_window`` and ``hedge_after`` override the client's for this call. With a
        ``hedge_after``, a member that has not answered within it does not hold the call
        up: the next member is asked too, and the first answer wins (``_pass_hedged``;
        0: every member at once; None: one member after the other). ``attempt_timeout``
        bounds each attempt below ``timeout`` (for an idempotent call that is better asked
        again: etcd drops a proposal made while a member has no raft leader, and the
        request then waits out its timeout even after a leader is elected).

        A mutation that timed out on one member may have been applied before the next member
        is asked (or, hedged, applied twice); callers guard mutations with txn comparisons
        or make them idempotent.
        """
        window = self.retry_window if retry_window == "default" else retry_window
        hedge = self.hedge_after if hedge_after == "default" else hedge_after
        delay = 0.05
        while True:
            began = time.monotonic()
            if hedge is not None and len(self.endpoints) > 1:
                data, failures = await self._pass_hedged(path, body, hedge, attempt_timeout)
            else:
                data, failures = await self._pass(path, body, attempt_timeout)
            if data is not None:
                self._reached()
                return data
            self._unreached("; ".join(failures), began)
            remaining = self._may_retry(window)
            if remaining <= 0:
                age = self.reachability.outage_age(time.monotonic())
                waited = f" for {age:.1f}s" if window else ""
                who = ("no etcd endpoint answered" if self.service == "etcd"
                       else f"{self.service} did not answer")
                raise EtcdUnavailable(f"{who} {path}{waited} ({'; '.join(failures)})")
            await anyio.sleep(min(delay, remaining))  # all failed: back off, then a new pass
            delay = min(delay * 2, 1.0)

    async def _ask(self, endpoint: str, path: str, body: JsonDict,
                   timeout: float | None = None) -> JsonDict:
        """One attempt on one member (bounded by ``timeout`` too, if given), noting in its
        health what the attempt showed."""
        try:
            with anyio.fail_after(timeout):
                data = await self._post_authenticated(endpoint, path, body)
        except (_EndpointDown, TimeoutError) as exc:
            logger.debug("etcd %s%s failed: %s", endpoint, path, _describe(exc))
            self.stats.failed_attempts += 1
            self.endpoint_health(endpoint).failed()
            self._avoid(endpoint)
            if isinstance(exc, TimeoutError):
                raise _EndpointDown(f"no answer in {timeout:g}s") from exc
            raise
        self.endpoint_health(endpoint).answered()
        self._prefer(endpoint)
        return data

    async def _pass(self, path: str, body: JsonDict, timeout: float | None = None
                    ) -> tuple[JsonDict | None, list[str]]:
        """Every member in turn until one answers: its reply (None if none did) and the
        failures on the way."""
        failures: list[str] = []
        for endpoint in self._rotation():
            try:
                return await self._ask(endpoint, path, body, timeout), failures
            except _EndpointDown as exc:
                failures.append(f"{endpoint}: {exc}")
        return None, failures

    async def _pass_hedged(self, path: str, body: JsonDict, after: float,
                           timeout: float | None = None) -> tuple[JsonDict | None, list[str]]:
        """Like ``_pass``, but the next member is asked as soon as the previous one failed
        or ``after`` seconds passed without its answer, the earlier ones still running:
        the first answer wins and the others are cancelled. A member that is cut off
        without an error (its traffic dropped) then costs ``after``, not ``timeout``.
        A member's refusal (``EtcdError``, e.g. lease not found) is an answer too."""
        replies: list[JsonDict] = []
        refusals: list[EtcdError] = []
        failures: list[str] = []

        async def ask(endpoint: str, failed: anyio.Event, done: anyio.CancelScope) -> None:
            try:
                replies.append(await self._ask(endpoint, path, body, timeout))
            except _EndpointDown as exc:
                failures.append(f"{endpoint}: {exc}")
                failed.set()
                return
            except EtcdError as exc:
                refusals.append(exc)
            done.cancel()

        async with anyio.create_task_group() as tg:
            for endpoint in list(self._rotation()):  # a list: the asks move the rotation
                failed = anyio.Event()
                tg.start_soon(ask, endpoint, failed, tg.cancel_scope)
                if after > 0:
                    with anyio.move_on_after(after):
                        await failed.wait()
        if replies:
            return replies[0], failures
        if refusals:
            raise refusals[0]
        return None, failures

    async def get(self, key: str, *, revision: int = 0) -> KeyValue | None:
        """The key (as of ``revision``, if > 0), or None if it does not exist."""
        result = await self.range(key, revision=revision)
        return result.kvs[0] if result.kvs else None

    async def range(self, key: str, *, prefix: bool = False, revision: int = 0,
                    retry_window: float | Literal["default"] | None = "default"
                    ) -> RangeResult:
        """The key (or every key under the prefix) and the store revision read; as of
        ``revision`` if > 0 (an error once etcd compacted that revision away)."""
        data = await self.call("/v3/kv/range", _key_range(key, prefix, revision),
                               retry_window=retry_window)
        kvs = tuple(KeyValue.from_json(kv) for kv in _objects(data.get("kvs", ())))
        return RangeResult(kvs, int(data["header"]["revision"]))

    async def count(self, key: str, *, prefix: bool = False) -> int:
        """How many keys (under the prefix) exist, without reading them."""
        body = _key_range(key, prefix)
        body["count_only"] = True
        data = await self.call("/v3/kv/range", body)
        return int(data.get("count", 0))

    async def put(self, key: str, value: str | bytes, *, lease: int = 0) -> int:
        """Store the key; the new revision."""
        data = await self.call("/v3/kv/put", put_op(key, value, lease=lease)["request_put"])
        return int(data["header"]["revision"])

    async def delete(self, key: str, *, prefix: bool = False) -> int:
        """Delete the key (or prefix); how many keys were deleted."""
        data = await self.call("/v3/kv/deleterange", _key_range(key, prefix))
        return int(data.get("deleted", 0))

    async def txn(
        self, compares: Sequence[JsonDict], success: Sequence[JsonDict] = (),
        failure: Sequence[JsonDict] = (),
    ) -> TxnResult:
        """Apply ``success`` if every comparison holds, else ``failure``, atomically."""
        body = {"compare": list(compares), "success": list(success), "failure": list(failure)}
        data = await self.call("/v3/kv/txn", body)
        self.stats.txns += 1
        if not data.get("succeeded", False):
            self.stats.txn_conflicts += 1
        return TxnResult(
            succeeded=bool(data.get("succeeded", False)),
            revision=int(data["header"]["revision"]),
            responses=tuple(data.get("responses", ())),
        )

    async def lease_grant(self, ttl: int, *, retry_window: float | Literal["default"] | None
                          = "default") -> tuple[int, int]:
        """A new lease; ``(lease_id, granted_ttl)`` (etcd may raise a too-small TTL)."""
        # hedged like any call: a grant answered twice leaves a lease with no key bound to
        # it and nobody refreshing it, which etcd expires after its TTL; harmless
        data = await self.call("/v3/lease/grant", {"TTL": str(ttl)}, retry_window=retry_window)
        return int(data["ID"]), int(data["TTL"])

    async def lease_keepalive(self, lease_id: int) -> int:
        """Refresh the lease; its TTL. Raises ``EtcdLeaseNotFound`` once it has expired."""
        data = await self.call("/v3/lease/keepalive", {"ID": str(lease_id)})
        ttl = int(data.get("result", data).get("TTL", 0))
        if ttl <= 0:
            raise EtcdLeaseNotFound(f"lease {lease_id:x} expired")
        return ttl

    async def lease_revoke(self, lease_id: int) -> None:
        """Revoke the lease, deleting every key bound to it."""
        await self.call("/v3/lease/revoke", {"ID": str(lease_id)})

    # what the client learnt about each member (watches follow it, see watch.py)

    @property
    def preferred(self) -> str:
        """The endpoint the next request goes to first: the last one that answered."""
        return self.endpoints[self._current]

    def endpoint_health(self, endpoint: str) -> EndpointHealth:
        """When ``endpoint`` last answered and last failed a request (monotonic)."""
        return self._health.setdefault(endpoint, EndpointHealth())

    async def probe(self, endpoint: str, key: str) -> None:
        """One linearizable read of ``key`` on ``endpoint`` alone (no failover): it needs
        the member's raft leader, so it fails on a member that is cut off or has no
        quorum. Raises ``EtcdUnavailable`` if the member did not answer in ``timeout``."""
        body = {**_key_range(key, False), "count_only": True}
        try:
            with anyio.fail_after(self.timeout):
                await self._post_authenticated(endpoint, "/v3/kv/range", body)
        except (_EndpointDown, TimeoutError) as exc:
            self.endpoint_health(endpoint).failed()
            raise EtcdUnavailable(f"{endpoint}: {_describe(exc)}") from exc
        self.endpoint_health(endpoint).answered()
