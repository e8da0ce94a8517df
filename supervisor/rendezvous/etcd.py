"""The etcd v3 rendezvous backend (DESIGN section 4).

Keys live under ``/elastic-supervisor/<run_id>/`` as JSON values::

    round                      {"round": N}        the current round (absent: 0)
    rounds/N/join/<node>       lease-bound         joined round N (address, local world size)
    rounds/N/wait/<node>       lease-bound         arrived after round N completed; wants in
    rounds/N/result            {"members": [...]}  round N is complete; members by node id
    rounds/N/master            {"addr", "port"}    published by group rank 0 of round N
    rounds/N/done/<node>       not lease-bound     finished its workers (exit barrier)
    restarts                   {"count": K}        job-wide failure restarts
    closed                     {"ok", "reason"}    the job is over for everyone

Every write is a txn guarded on what this node last saw, and every wait follows the prefix
by watch (``PrefixView``), so nothing polls. A round completes when ``max_nodes`` joined,
when ``last_call_timeout`` passed since ``min_nodes`` joined, or (improvement over torch)
as soon as every live node of the previous round has rejoined, so restarts skip the last
call. Group ranks follow node ids, which keeps them stable across rounds.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
from anyio.abc import TaskStatus

from supervisor.rendezvous.base import (
    BarrierResult,
    RendezvousClosed,
    RendezvousError,
    RendezvousResult,
    free_port,
)
from supervisor.rendezvous.etcd_client import (
    EtcdClient,
    EtcdError,
    EtcdLeaseNotFound,
    EtcdUnavailable,
    KeyValue,
    PrefixView,
    TlsFiles,
    compare,
    delete_op,
    open_prefix_view,
    put_op,
)

logger = logging.getLogger(__name__)

ROOT = "/elastic-supervisor"
_CAS_ATTEMPTS = 50


# configuration


class RendezvousConfigError(ValueError):
    """A bad rendezvous setting; the message is one line meant for the user."""


def _default_node_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass(frozen=True)
class EtcdRendezvousConfig:
    """Settings of the etcd backend, validated on creation. ``local_addr`` "" means this
    host's FQDN, or 127.0.0.1 when every endpoint is on loopback."""

    endpoints: tuple[str, ...]
    run_id: str
    min_nodes: int
    max_nodes: int
    node_id: str = field(default_factory=_default_node_id)  # unique per agent
    local_addr: str = ""
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    lease_ttl: int = 10
    exit_barrier_timeout: float = 300.0
    request_timeout: float = 5.0
    tls: TlsFiles | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    # seconds etcd may be unreachable before this node gives up (None: the lease TTL)
    outage_limit: float | None = None

    def __post_init__(self) -> None:
        _check(bool(self.endpoints), "--rdzv-endpoint: at least one etcd endpoint is required")
        for name, value in (("--rdzv-id", self.run_id), ("node id", self.node_id)):
            _check(bool(value) and "/" not in value and value.isprintable(),
                   f"{name} must be non-empty, printable and without '/': {value!r}")
        _check(1 <= self.min_nodes <= self.max_nodes,
               f"--nnodes: need 1 <= MIN <= MAX, got {self.min_nodes}:{self.max_nodes}")
        for name in ("join_timeout", "last_call_timeout", "lease_ttl", "exit_barrier_timeout",
                     "request_timeout"):
            value = getattr(self, name)
            _check(0 < value < math.inf, f"{name} must be a positive number, got {value}")
        _check(self.outage_limit is None or 0 < self.outage_limit < math.inf,
               f"outage_limit must be a positive number, got {self.outage_limit}")
        if not self.local_addr:
            object.__setattr__(self, "local_addr", _default_local_addr(self.endpoints))

    @property
    def unreachable_limit(self) -> float:
        """Seconds etcd may be unreachable before this node gives up."""
        return self.lease_ttl if self.outage_limit is None else self.outage_limit


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RendezvousConfigError(message)


def _default_local_addr(endpoints: tuple[str, ...]) -> str:
    try:
        loopback = all(ipaddress.ip_address(urlsplit(e).hostname or "").is_loopback
                       for e in endpoints)
    except ValueError:  # a host name
        loopback = all(urlsplit(e).hostname == "localhost" for e in endpoints)
    return "127.0.0.1" if loopback else socket.getfqdn()


_CONF_KEYS: dict[str, type] = {
    "join_timeout": float, "timeout": float, "last_call_timeout": float, "lease_ttl": int,
    "exit_barrier_timeout": float, "request_timeout": float, "outage_limit": float,
    "node_id": str, "protocol": str,
    "cacert": str, "cert": str, "key": str, "user": str, "password_file": str,
}


def parse_rdzv_conf(text: str) -> dict[str, str | int | float]:
    """Parse ``--rdzv-conf k=v,...`` (``timeout`` is torchrun's name for ``join_timeout``)."""
    conf: dict[str, str | int | float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = (x.strip() for x in item.partition("="))
        _check(bool(sep and key), f"--rdzv-conf: expected key=value, got {item!r}")
        kind = _CONF_KEYS.get(key)
        _check(kind is not None,
               f"--rdzv-conf: unknown key {key!r} (known: {', '.join(sorted(_CONF_KEYS))})")
        conf["join_timeout" if key == "timeout" else key] = _conf_value(key, raw, kind or str)
    _check(conf.get("protocol", "http") in ("http", "https"),
           f"--rdzv-conf: protocol must be http or https, got {conf.get('protocol')!r}")
    return conf


def _conf_value(key: str, raw: str, kind: type) -> str | int | float:
    if kind is str:
        _check(bool(raw), f"--rdzv-conf: {key} is empty")
        return raw
    noun = "an integer" if kind is int else "a number"
    try:
        value: int | float = kind(raw)
    except ValueError:
        raise RendezvousConfigError(f"--rdzv-conf: {key}={raw!r} is not {noun}") from None
    _check(0 < value < math.inf, f"--rdzv-conf: {key} must be positive, got {raw!r}")
    return value


def parse_nnodes(text: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` -> (min, max)."""
    parts = text.split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        low, high = 0, -1
    _check(1 <= low <= high, f"--nnodes: expected N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return low, high


def parse_endpoints(text: str, *, https: bool = False) -> tuple[str, ...]:
    """``host[:port],...`` (or URLs) -> URLs; the port defaults to 2379."""
    urls = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        url = item if "://" in item else f"{'https' if https else 'http'}://{item}"
        try:
            parsed = urlsplit(url)
            port = parsed.port or 2379
        except ValueError:
            raise RendezvousConfigError(f"--rdzv-endpoint: bad endpoint {item!r}") from None
        _check(parsed.scheme in ("http", "https") and bool(parsed.hostname),
               f"--rdzv-endpoint: bad endpoint {item!r}")
        host = f"[{parsed.hostname}]" if ":" in (parsed.hostname or "") else parsed.hostname
        urls.append(f"{parsed.scheme}://{host}:{port}")
    _check(bool(urls), "--rdzv-endpoint: at least one etcd endpoint is required")
    return tuple(urls)


def make_config(*, endpoint: str, run_id: str, nnodes: str, rdzv_conf: str = "",
                local_addr: str | None = None) -> EtcdRendezvousConfig:
    """Build the config from torchrun-style flags; raises ``RendezvousConfigError``."""
    conf = parse_rdzv_conf(rdzv_conf)
    files = {k: str(conf[k]) for k in ("cacert", "cert", "key") if k in conf}
    https = conf.get("protocol") == "https" or bool(files)
    min_nodes, max_nodes = parse_nnodes(nnodes)
    password = None
    if "password_file" in conf:
        try:
            password = Path(str(conf["password_file"])).read_text().rstrip("\n")
        except OSError as exc:
            raise RendezvousConfigError(f"--rdzv-conf: password_file: {exc.strerror}") from None
    passed: dict[str, Any] = {k: v for k, v in conf.items()
                              if k.endswith(("_timeout", "_ttl"))
                              or k in ("node_id", "user", "outage_limit")}
    return EtcdRendezvousConfig(
        endpoints=parse_endpoints(endpoint, https=https), run_id=run_id,
        min_nodes=min_nodes, max_nodes=max_nodes, local_addr=local_addr or "",
        tls=TlsFiles(**files) if https else None, password=password, **passed,
    )


@contextmanager
def _etcd_errors(what: str) -> Iterator[None]:
    try:
        yield
    except EtcdError as exc:
        raise RendezvousError(f"etcd rendezvous: {what} failed: {exc}") from exc


@dataclass(frozen=True)
class _Member:
    node: str
    addr: str
    local_world_size: int


_Done = tuple[list[_Member], tuple[str, int]]  # a finished round: members, (addr, port)


class _State:
    """The job's keys as one node last saw them (a read-only view of a ``PrefixView``)."""

    def __init__(self, prefix: str, kvs: Mapping[str, KeyValue]) -> None:
        self._prefix = prefix
        self._kvs = kvs

    def kv(self, *parts: object) -> KeyValue | None:
        return self._kvs.get(self._prefix + "/".join(map(str, parts)))

    def json(self, *parts: object) -> Any:
        kv = self.kv(*parts)
        if kv is None:
            return None
        try:
            return json.loads(kv.value)
        except ValueError as exc:
            raise RendezvousError(f"etcd rendezvous: {kv.key} holds malformed JSON") from exc

    @property
    def round(self) -> int:
        data = self.json("round")
        return int(data["round"]) if data else 0

    @property
    def round_mod(self) -> int:
        kv = self.kv("round")
        return kv.mod_revision if kv else 0

    @property
    def closed(self) -> dict[str, Any] | None:
        data: dict[str, Any] | None = self.json("closed")
        return data

    def nodes(self, n: int, kind: str) -> dict[str, KeyValue]:
        """Node id -> key of ``rounds/n/<kind>/``."""
        prefix = f"{self._prefix}rounds/{n}/{kind}/"
        return {k[len(prefix):]: kv for k, kv in self._kvs.items() if k.startswith(prefix)}

    def members(self, n: int) -> list[_Member] | None:
        data = self.json("rounds", n, "result")
        return [_Member(**m) for m in data["members"]] if data else None

    def master(self, n: int) -> tuple[str, int] | None:
        data = self.json("rounds", n, "master")
        return (str(data["addr"]), int(data["port"])) if data else None


class _LeaseKeeper:
    """This agent's lease, refreshed every TTL/3; survives outages shorter than the TTL."""

    def __init__(self, client: EtcdClient, ttl: int, limit: float | None = None) -> None:
        self._client = client
        self.id = 0
        self.ttl = ttl
        self.limit = limit  # seconds of outage to ride out (None: the TTL)
        self.lost = anyio.Event()
        self.lost_reason = ""
        self._stopped = anyio.Event()

    async def grant(self) -> None:
        self.id, self.ttl = await self._client.lease_grant(self.ttl)
        logger.info("etcd lease %x granted (ttl %ds)", self.id, self.ttl)

    async def keep_alive(self) -> None:
        """Refresh until stopped or lost; on failure retry quickly until the TTL runs out."""
        last_ok, interval = time.monotonic(), self.ttl / 3
        limit = self.ttl if self.limit is None else self.limit
        while True:
            with anyio.move_on_after(interval):
                await self._stopped.wait()
            if self._stopped.is_set():
                return
            sent = time.monotonic()
            try:
                with anyio.fail_after(max(last_ok + limit - sent, 0.01)):
                    await self._client.lease_keepalive(self.id)
            except EtcdLeaseNotFound:
                return self._mark_lost(f"etcd lease {self.id:x} expired")
            except (EtcdError, TimeoutError) as exc:
                if self._stopped.is_set():
                    return
                if time.monotonic() - last_ok >= limit:
                    what = "the lease TTL" if self.limit is None else "outage_limit"
                    return self._mark_lost(
                        f"etcd unreachable for longer than {what} ({limit:g}s): "
                        f"{str(exc) or 'no answer'}")
                logger.warning("etcd lease keepalive failed, retrying: %s", exc)
                interval = min(self.ttl / 10, 0.5)
                continue
            last_ok, interval = sent, self.ttl / 3

    def _mark_lost(self, reason: str) -> None:
        logger.error("rendezvous membership lost: %s", reason)
        self.lost_reason = reason
        self.lost.set()

    async def revoke(self) -> None:
        """Stop refreshing and revoke, so this node's keys vanish now (best effort)."""
        self._stopped.set()
        if not self.id or self.lost.is_set():
            return
        try:
            await self._client.lease_revoke(self.id)
        except EtcdLeaseNotFound:
            pass
        except EtcdError as exc:
            logger.warning("could not revoke etcd lease (it expires in %ds): %s", self.ttl, exc)


class EtcdRendezvous:
    """The ``Rendezvous`` backend over etcd v3. Start ``run`` in a task group first."""

    backend = "etcd"

    def __init__(self, config: EtcdRendezvousConfig) -> None:
        self.config = config
        self.run_id = config.run_id
        self.node_id = config.node_id
        self._prefix = f"{ROOT}/{config.run_id}/"
        # Ride out any outage shorter than the lease (the keys survive it), trying every
        # member within one TTL even when one hangs.
        timeout = min(config.request_timeout, config.lease_ttl / 3)
        self._client = EtcdClient(config.endpoints, timeout=timeout,
                                  tls=config.tls, user=config.user, password=config.password,
                                  retry_window=config.unreachable_limit)
        self._lease = _LeaseKeeper(self._client, config.lease_ttl, config.outage_limit)
        self._running = False
        self._left = False
        self._closed = anyio.Event()
        self._last_round = -1  # the last round this node was handed
        self._min_since: tuple[int, float] | None = None  # (round, when min_nodes was seen)
        self._progress = "nothing read yet"

    @property
    def lease_id(self) -> int:
        """This agent's etcd lease (0 before ``run`` took it)."""
        return self._lease.id

    # lifecycle

    async def connect(self) -> None:
        """Take this node's lease (once). An unreachable etcd is retried until
        ``join_timeout`` (nodes often start before the service is up); raises
        ``RendezvousError`` if etcd is still unreachable then, or refuses."""
        if self._lease.id:
            return
        deadline = time.monotonic() + self.config.join_timeout
        last = "no answer"
        with _etcd_errors(f"taking a lease from {', '.join(self.config.endpoints)}"):
            while True:
                try:
                    with anyio.fail_after(max(deadline - time.monotonic(), 0.01)):
                        await self._lease.grant()
                    return
                except (EtcdUnavailable, TimeoutError) as exc:
                    if time.monotonic() >= deadline:
                        why = str(exc) or last
                        message = f"unreachable for {self.config.join_timeout:g}s: {why}"
                        raise EtcdUnavailable(message) from exc
                    if last == "no answer":  # once: a node may wait minutes for the service
                        logger.info("etcd not reachable yet, retrying until join_timeout "
                                    "(%gs): %s", self.config.join_timeout, exc)
                    last = str(exc) or last

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Connect (if not yet), report ready, then keep the lease alive until ``aclose()``
        or cancellation; leaves and releases everything on the way out."""
        try:
            await self.connect()
            self._running = True
            task_status.started()
            await self._lease.keep_alive()
            await self._closed.wait()
        finally:
            with anyio.CancelScope(shield=True):
                await self.aclose()

    async def leave(self) -> None:
        """Revoke the lease: this node's keys vanish, the others re-form; the job goes on."""
        if not self._left:
            self._left = True
            if not self._lease.id:
                return  # never joined (etcd was unreachable): nothing to leave
            with anyio.move_on_after(self.config.request_timeout):
                await self._lease.revoke()
            logger.info("left etcd rendezvous %s as %s", self.run_id, self.node_id)

    async def aclose(self) -> None:
        """Leave (if not done yet) and close connections. Idempotent."""
        if self._closed.is_set():
            return
        await self.leave()
        self._closed.set()
        await self._client.aclose()

    def _check_usable(self) -> None:
        if not self._running:
            raise RuntimeError("EtcdRendezvous.run() must be started before use")
        if self._left:
            raise RendezvousError("this node already left the etcd rendezvous")
        if self._lease.lost.is_set():
            raise RendezvousError(self._lease.lost_reason)

    def _key(self, *parts: object) -> str:
        return self._prefix + "/".join(map(str, parts))

    @asynccontextmanager
    async def _view(self) -> AsyncIterator[PrefixView]:
        async with open_prefix_view(self._client, self._prefix) as view:
            yield view

    def _state(self, view: PrefixView) -> _State:
        return _State(self._prefix, view.kvs)

    async def _wait(self, view: PrefixView, seen: int, deadline: float = math.inf) -> None:
        """Until the view moves past version ``seen``, ``deadline`` passes or the lease is lost."""
        failure: EtcdError | None = None
        with anyio.move_on_after(deadline - time.monotonic()):
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._cancel_on_loss, tg.cancel_scope)
                try:
                    await view.wait_changed(seen)
                except EtcdError as exc:  # raised below, not wrapped in an ExceptionGroup
                    failure = exc
                tg.cancel_scope.cancel()
        if failure is not None:
            raise failure
        self._check_usable()

    async def _cancel_on_loss(self, scope: anyio.CancelScope) -> None:
        await self._lease.lost.wait()
        scope.cancel()

    async def _write(self, view: PrefixView, compares: list[dict[str, Any]],
                     success: list[dict[str, Any]]) -> bool:
        """A guarded txn; then re-read so the next decision sees its effect."""
        result = await self._client.txn(compares, success)
        await view.refresh()
        return result.succeeded

    def _is_mine(self, kv: KeyValue | None) -> bool:
        return kv is not None and kv.lease == self._lease.id

    # rounds

    async def next_round(self, local_world_size: int) -> RendezvousResult:
        """Join the next round and wait (at most ``join_timeout``) until it completes."""
        self._check_usable()
        started = time.monotonic()
        result: RendezvousResult | None = None
        with _etcd_errors("joining a round"), anyio.move_on_after(self.config.join_timeout):
            async with self._view() as view:
                result = await self._rendezvous(view, local_world_size, started)
        if result is None:
            raise RendezvousError(f"etcd rendezvous {self.run_id} timed out after "
                                  f"{self.config.join_timeout:g}s: {self._progress}")
        logger.info("etcd rendezvous round %d complete in %.3fs: group rank %d of %d, "
                    "master %s:%d", result.round, result.duration, result.group_rank,
                    result.group_world_size, result.master_addr, result.master_port)
        return result

    async def _rendezvous(self, view: PrefixView, lws: int, started: float) -> RendezvousResult:
        while True:
            seen, state = view.version, self._state(view)
            if state.closed is not None:
                raise RendezvousClosed(f"job {self.run_id} is closed: {state.closed['reason']}")
            step = await self._step(view, state, lws)
            if isinstance(step, tuple):
                return self._result(state.round, *step, started)
            await self._wait(view, seen, step)

    async def _step(self, view: PrefixView, state: _State, lws: int) -> _Done | float:
        """One decision: the members and master of a finished round, or a deadline to wait
        until (0: decide again now, inf: until something changes)."""
        n = state.round
        members = state.members(n)
        if members is None:
            return await self._joining(view, state, n, lws)
        is_member = self.node_id in {m.node for m in members}
        if is_member and self._is_mine(state.nodes(n, "join").get(self.node_id)):
            if n > self._last_round:
                return await self._finishing(view, state, n, members)
            await self._advance(view, state, n)  # restarting from a round it already ran
            return 0.0
        return await self._waiting(view, state, n, members)

    async def _joining(self, view: PrefixView, state: _State, n: int, lws: int) -> float:
        joined = state.nodes(n, "join")
        cfg = self.config
        self._progress = (f"round {n}: {len(joined)} node(s) joined, need {cfg.min_nodes} "
                          f"(max {cfg.max_nodes})")
        if not self._is_mine(joined.get(self.node_id)):
            me = _Member(self.node_id, cfg.local_addr, lws)
            await self._write(view, [
                *self._round_guard(state),
                compare(self._key("rounds", n, "result"), "VERSION", "=", 0)],
                [put_op(self._key("rounds", n, "join", self.node_id), json.dumps(asdict(me)),
                        lease=self._lease.id)])
            return 0.0
        if len(joined) < cfg.min_nodes:
            self._min_since = None
            return math.inf
        if len(joined) >= cfg.max_nodes or self._previous_round_rejoined(state, n, joined):
            await self._complete(view, state, n, joined)
            return 0.0
        if self._min_since is None or self._min_since[0] != n:
            self._min_since = (n, time.monotonic())
        last_call = self._min_since[1] + cfg.last_call_timeout
        if time.monotonic() >= last_call:
            await self._complete(view, state, n, joined)
            return 0.0
        return last_call

    def _previous_round_rejoined(self, state: _State, n: int, joined: dict[str, KeyValue]) -> bool:
        """Every node still alive from round n-1 (members and waiters) joined round n."""
        if n == 0 or state.members(n - 1) is None:
            return False
        alive = set(state.nodes(n - 1, "join")) | set(state.nodes(n - 1, "wait"))
        return bool(alive) and alive <= set(joined)

    def _round_guard(self, state: _State) -> list[dict[str, Any]]:
        """Comparisons: the round did not move on and the job is not closed."""
        return [compare(self._key("round"), "MOD", "=", state.round_mod),
                compare(self._key("closed"), "VERSION", "=", 0)]

    async def _complete(self, view: PrefixView, state: _State, n: int,
                        joined: dict[str, KeyValue]) -> None:
        chosen = sorted(joined.values(), key=lambda kv: kv.create_revision)
        chosen = chosen[: self.config.max_nodes]
        members = sorted((json.loads(kv.value) for kv in chosen), key=lambda m: str(m["node"]))
        guard = self._round_guard(state) + [
            compare(self._key("rounds", n, "result"), "VERSION", "=", 0),
            compare(self._key("rounds", n, "join", ""), "MOD", "<", view.revision + 1,
                    prefix=True),
        ] + [compare(kv.key, "CREATE", "=", kv.create_revision) for kv in chosen]
        result = put_op(self._key("rounds", n, "result"), json.dumps({"members": members}))
        if await self._write(view, guard, [result]):
            logger.info("etcd rendezvous round %d closed with %d node(s)", n, len(members))

    async def _finishing(self, view: PrefixView, state: _State, n: int,
                         members: list[_Member]) -> _Done | float:
        joined = state.nodes(n, "join")
        if any(m.node not in joined for m in members):
            await self._advance(view, state, n)  # a member died before the round started
            return 0.0
        master = state.master(n)
        if master is not None:
            return members, master
        if members[0].node == self.node_id:
            addr = members[0].addr
            await self._write(view, [
                *self._round_guard(state),
                compare(self._key("rounds", n, "master"), "VERSION", "=", 0)],
                [put_op(self._key("rounds", n, "master"),
                        json.dumps({"addr": addr, "port": free_port(addr)}))])
            return 0.0
        self._progress = f"round {n}: waiting for group rank 0 to publish the master port"
        return math.inf

    async def _waiting(self, view: PrefixView, state: _State, n: int,
                       members: list[_Member]) -> float:
        """This node is not in round n: ask the members for a new round, or start one."""
        joined = state.nodes(n, "join")
        if not any(m.node in joined for m in members):
            await self._advance(view, state, n)  # nobody of round n is left
            return 0.0
        if not self._is_mine(state.nodes(n, "wait").get(self.node_id)):
            await self._write(view, self._round_guard(state), [put_op(
                self._key("rounds", n, "wait", self.node_id), "{}", lease=self._lease.id)])
            return 0.0
        self._progress = (f"waiting to be admitted: round {n} runs with {len(members)} "
                          f"node(s) (max {self.config.max_nodes})")
        return math.inf

    async def _advance(self, view: PrefixView, state: _State, n: int) -> None:
        """Open round n+1 (if nobody did yet) and forget round n-1."""
        ops = [put_op(self._key("round"), json.dumps({"round": n + 1}))]
        if n >= 1:
            ops.append(delete_op(self._key("rounds", n - 1, ""), prefix=True))
        if await self._write(view, self._round_guard(state), ops):
            logger.info("etcd rendezvous: opened round %d", n + 1)

    def _result(self, n: int, members: list[_Member], master: tuple[str, int],
                started: float) -> RendezvousResult:
        ids = [m.node for m in members]
        rank = ids.index(self.node_id)
        sizes = [m.local_world_size for m in members]
        self._last_round = n
        return RendezvousResult(
            round=n, group_rank=rank, group_world_size=len(members),
            rank_offset=sum(sizes[:rank]), world_size=sum(sizes),
            master_addr=master[0], master_port=master[1], members=tuple(ids),
            duration=time.monotonic() - started,
        )

    # while the round runs

    async def wait_membership_change(self, result: RendezvousResult) -> str:
        """Return why round ``result`` is outdated: a node waits and there is room, a member
        vanished, another node opened a new round, or the job closed. Raises
        ``RendezvousError`` if this node's own lease is lost."""
        self._check_usable()
        with _etcd_errors("watching membership"):
            async with self._view() as view:
                while True:
                    seen = view.version
                    reason = self._membership_change(self._state(view), result)
                    if reason is not None:
                        logger.info("etcd rendezvous round %d outdated: %s", result.round, reason)
                        return reason
                    await self._wait(view, seen)

    def _membership_change(self, state: _State, result: RendezvousResult) -> str | None:
        n = result.round
        if state.closed is not None:
            return f"job closed: {state.closed['reason']}"
        if state.round > n:
            return f"round {state.round} was opened by another node"
        joined, done = state.nodes(n, "join"), state.nodes(n, "done")
        if not self._is_mine(joined.get(self.node_id)):
            raise RendezvousError(f"this node's etcd lease {self._lease.id:x} was lost")
        lost = [m for m in result.members if m not in joined and m not in done]
        if lost:
            return f"node(s) lost: {', '.join(lost)}"
        waiting = state.nodes(n, "wait")
        # Once a node finished, the job is ending: do not restart it for a newcomer.
        if waiting and not done and len(result.members) < self.config.max_nodes:
            return f"node(s) waiting to join: {', '.join(sorted(waiting))}"
        return None

    async def exit_barrier(self, result: RendezvousResult, timeout: float) -> BarrierResult:
        """Mark this node done for the round and wait (at most ``timeout``) for the others.
        On success the job is closed as succeeded; ok=False at once if it failed or moved on."""
        pending: list[str] = list(result.members)
        try:
            with _etcd_errors("exit barrier"), anyio.move_on_after(timeout):
                await self._client.put(self._key("rounds", result.round, "done", self.node_id),
                                       "{}")  # not lease-bound: it must outlive this node
                async with self._view() as view:
                    while True:
                        seen, state = view.version, self._state(view)
                        pending = [m for m in result.members
                                   if m not in state.nodes(result.round, "done")]
                        verdict = self._barrier_verdict(state, result, pending)
                        if verdict is not None:
                            return await self._after_barrier(state, verdict)
                        await view.wait_changed(seen)
        except RendezvousError as exc:
            return BarrierResult(False, str(exc))
        return BarrierResult(False, f"exit barrier timed out after {timeout:g}s waiting for "
                                    f"{', '.join(pending)}")

    def _barrier_verdict(self, state: _State, result: RendezvousResult,
                         pending: list[str]) -> BarrierResult | None:
        if not pending:
            return BarrierResult(True, f"all {len(result.members)} node(s) finished")
        closed = state.closed
        if closed is not None and not closed.get("ok"):
            return BarrierResult(False, f"job failed: {closed['reason']}")
        if state.round > result.round:
            return BarrierResult(False, f"round {state.round} was opened during the exit barrier")
        lost = [m for m in pending if m not in state.nodes(result.round, "join")]
        if lost:
            return BarrierResult(False, f"node(s) lost before finishing: {', '.join(lost)}")
        return None

    async def _after_barrier(self, state: _State, verdict: BarrierResult) -> BarrierResult:
        if verdict.ok:
            await self._close(ok=True, reason="job succeeded")
        elif state.closed is None:
            # The job moved on (a restart opened a new round, or a member was lost and one
            # will be): this node is done and never rejoins, so the others would wait for it
            # until join_timeout. Close the job, as torchrun's finished agent does.
            await self._close(ok=False, reason=f"node {self.node_id} had finished its "
                                               f"workers when {verdict.message}")
        return verdict

    # job-wide

    async def record_failure_restart(self, message: str) -> int:
        """Add one failure restart to the job-wide counter (compare-and-swap); the new count."""
        key = self._key("restarts")
        with _etcd_errors("counting a restart"):
            for _ in range(_CAS_ATTEMPTS):
                kv = await self._client.get(key)
                count = (json.loads(kv.value)["count"] if kv else 0) + 1
                value = json.dumps({"count": count, "last": message, "node": self.node_id})
                guard = [compare(key, "MOD", "=", kv.mod_revision if kv else 0)]
                if (await self._client.txn(guard, [put_op(key, value)])).succeeded:
                    return int(count)
        raise RendezvousError("etcd rendezvous: restart counter too contended to update")

    async def restart_count(self) -> int:
        """The job-wide failure restart count."""
        with _etcd_errors("reading the restart counter"):
            kv = await self._client.get(self._key("restarts"))
        return int(json.loads(kv.value)["count"]) if kv else 0

    async def fail_job(self, message: str) -> None:
        """Close the job for every node (the first reason recorded wins)."""
        with _etcd_errors("closing the job"):
            await self._close(ok=False, reason=message)
        logger.error("etcd rendezvous %s closed as failed: %s", self.run_id, message)

    async def _close(self, *, ok: bool, reason: str) -> None:
        key = self._key("closed")
        value = json.dumps({"ok": ok, "reason": reason, "node": self.node_id})
        await self._client.txn([compare(key, "VERSION", "=", 0)], [put_op(key, value)])


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
