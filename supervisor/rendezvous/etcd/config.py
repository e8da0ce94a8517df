"""Settings of the etcd rendezvous backend: the typed config and the torchrun-style flags
(``--rdzv-endpoint``, ``--nnodes``, ``--rdzv-conf k=v,...``) it is parsed from, once."""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import secrets
import socket
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from supervisor.rendezvous.conf import RendezvousConfigError as RendezvousConfigError
from supervisor.rendezvous.conf import read_conf
from supervisor.rendezvous.etcd.wire.client import TlsFiles

logger = logging.getLogger(__name__)


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
    node_id: str = ""  # unique per agent; "" makes one (host:pid:random)
    # who failures are counted against (survives a restart of the supervisor):
    # "" means node_id when it was given, else the host name
    health_id: str = ""
    local_addr: str = ""
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    lease_ttl: int = 10
    exit_barrier_timeout: float = 300.0
    request_timeout: float = 5.0
    # Seconds etcd may stay unreachable before the rendezvous gives up (None: for as long
    # as the outage lasts; the workers run on meanwhile). c10d's hosted etcd sets a bound.
    outage_limit: float | None = None
    wait_report_every: float = 30.0  # seconds between lines about a wait (waitreport)
    tls: TlsFiles | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    # what messages call the service: "etcd" as the user configured it, or for c10d "the
    # rendezvous host HOST:PORT" (a c10d user never set up an etcd)
    service: str = "etcd"

    @property
    def label(self) -> str:
        """The prefix of the rendezvous' log lines ("etcd rendezvous", or "rendezvous")."""
        return "etcd rendezvous" if self.service == "etcd" else "rendezvous"

    def __post_init__(self) -> None:
        if not self.health_id:
            object.__setattr__(self, "health_id", self.node_id or socket.gethostname())
        if not self.node_id:
            object.__setattr__(self, "node_id", _default_node_id())
        _check(bool(self.endpoints), "--rdzv-endpoint: at least one etcd endpoint is required")
        for name, value in (("--rdzv-id", self.run_id), ("node id", self.node_id),
                            ("node id", self.health_id)):
            _check(bool(value) and "/" not in value and value.isprintable(),
                   f"{name} must be non-empty, printable and without '/': {value!r}")
        _check(1 <= self.min_nodes <= self.max_nodes,
               f"--nnodes: need 1 <= MIN <= MAX, got {self.min_nodes}:{self.max_nodes}")
        for name in ("join_timeout", "last_call_timeout", "lease_ttl", "exit_barrier_timeout",
                     "request_timeout", "wait_report_every"):
            value = getattr(self, name)
            _check(0 < value < math.inf, f"{name} must be a positive number, got {value}")
        _check(self.outage_limit is None or 0 < self.outage_limit < math.inf,
               f"outage_limit must be a positive number or None, got {self.outage_limit}")
        if not self.local_addr:
            object.__setattr__(self, "local_addr", _default_local_addr(self.endpoints))


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
    "exit_barrier_timeout": float, "request_timeout": float, "node_id": str, "protocol": str,
    "cacert": str, "cert": str, "key": str, "user": str, "password_file": str,
    "outage_limit": float,
}
_NO_LIMIT = ("none", "inf", "unlimited")
_TLS_RENAMED = {"ssl_cert": "cert", "ssl_cert_key": "key", "ca_cert": "cacert"}


def parse_rdzv_conf(text: str) -> dict[str, str | int | float | None]:
    """Parse ``--rdzv-conf k=v,...`` (``timeout`` is torchrun's name for ``join_timeout``;
    ``outage_limit=none`` means no limit). Unknown keys are ignored with a warning, as
    torchrun ignores them (``supervisor.rendezvous.conf``)."""
    conf: dict[str, str | int | float | None] = {}
    read = read_conf(text, {**_CONF_KEYS, **_TLS_RENAMED}, "etcd")
    for key, raw in read.items:
        # a TLS setting that did nothing would be worse than an error: never ignored
        _check(key not in _TLS_RENAMED,
               f"--rdzv-conf: {key} is torch's etcd-v2 name; here it is {_TLS_RENAMED.get(key)}")
        conf["join_timeout" if key == "timeout" else key] = _conf_value(key, raw, _CONF_KEYS[key])
    _check(conf.get("protocol", "http") in ("http", "https"),
           f"--rdzv-conf: protocol must be http or https, got {conf.get('protocol')!r}")
    for warning in read.warnings:  # after the checks: a bad value is one line, not two
        logger.warning("%s", warning)
    return conf


def _conf_value(key: str, raw: str, kind: type) -> str | int | float | None:
    if key == "outage_limit" and raw.lower() in _NO_LIMIT:
        return None
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
    for one, other in (("cert", "key"), ("key", "cert")):
        _check(one not in files or other in files,
               f"--rdzv-conf: {one}= needs {other}= (a client certificate and its key go "
               f"together)")
    tls = TlsFiles(**files) if https else None
    if tls is not None:
        _load(tls)
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
        tls=tls, password=password, **passed,
    )


def _load(tls: TlsFiles) -> None:
    """Read the TLS files now: a missing or unreadable one is a one-line start-up error,
    not a failure on the first request."""
    for name in ("cacert", "cert", "key"):
        path = getattr(tls, name)
        if path is None:
            continue
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise RendezvousConfigError(f"--rdzv-conf: {name}={path}: {exc.strerror}") from None
    try:
        tls.ssl_context()
    except ssl.SSLError as exc:
        raise RendezvousConfigError(f"--rdzv-conf: the TLS files do not load: {exc}") from None
