"""The c10d backend's settings from torchrun's flags: the endpoint, who hosts
(``is_host``), torchrun's ``--rdzv-conf`` keys and those of the etcd rendezvous that
apply here, checked once (``RendezvousConfigError``)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from supervisor.rendezvous.conf import read_conf
from supervisor.rendezvous.etcd.config import (
    EtcdRendezvousConfig,
    RendezvousConfigError,
    make_config,
)

logger = logging.getLogger("supervisor.rendezvous.c10d")  # the backend's lines, whichever module

DEFAULT_PORT = 29400  # torchrun's c10d default

# --rdzv-conf keys: torchrun's c10d keys, then those of our etcd backend that apply here
_TORCHRUN_KEYS = ("join_timeout", "timeout", "last_call_timeout", "close_timeout",
                  "read_timeout", "is_host")
_ETCD_KEYS = ("lease_ttl", "exit_barrier_timeout", "request_timeout", "outage_limit",
              "node_id", "cacert", "cert", "key", "user", "password_file")
_ETCD_ONLY_KEYS = ("protocol",)  # TLS is implied by the files: no protocol= for c10d
_TRUE, _FALSE = ("1", "true", "t", "yes", "y"), ("0", "false", "f", "no", "n")


@dataclass(frozen=True)
class C10dConfig:
    """Settings of the c10d backend: the endpoint, who hosts, and the etcd rendezvous."""

    host: str
    port: int
    is_host: bool | None  # None: decide as torchrun does
    close_timeout: float
    etcd: EtcdRendezvousConfig
    local_addr: str | None = None  # --local-addr: the hosted etcd serves it too

    @property
    def secured(self) -> bool:
        """Whether the hosted etcd requires client certificates (cacert, cert, key)."""
        return self.etcd.tls is not None

    @property
    def endpoint(self) -> str:
        return f"{bracket(self.host)}:{self.port}"


def bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RendezvousConfigError(message)


def parse_endpoint(text: str) -> tuple[str, int]:
    """torchrun's ``parse_rendezvous_endpoint``: ``HOST[:PORT]`` (IPv6 in brackets); empty
    means ``localhost``; the port defaults to 29400."""
    text = text.strip()
    if not text:
        return "localhost", DEFAULT_PORT
    _check("," not in text, f"--rdzv-endpoint: c10d takes one HOST[:PORT], got {text!r}")
    if text.startswith("[") and text.endswith("]"):
        host, rest = text[1:-1], None
    else:
        host, sep, rest_text = text.rpartition(":")
        host, rest = (host, rest_text) if sep and "]" not in rest_text else (text, None)
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    port = DEFAULT_PORT
    if rest is not None:
        _check(rest.isascii() and rest.isdigit() and int(rest) < 65536,
               f"--rdzv-endpoint: the port of {text!r} must be 0..65535")
        port = int(rest)
    _check(bool(host) and all(c.isalnum() or c in ".:-_" for c in host),
           f"--rdzv-endpoint: bad host in {text!r}")
    return host, port


def _split_conf(text: str) -> tuple[dict[str, str], str, tuple[str, ...]]:
    """(c10d-only keys, the rest as ``k=v,...`` for the etcd backend's parser, warnings)."""
    own: dict[str, str] = {}
    passed: list[str] = []
    read = read_conf(text, _TORCHRUN_KEYS + _ETCD_KEYS + _ETCD_ONLY_KEYS, "c10d")
    for key, value in read.items:
        # known, but meaningless for the hosted etcd: refused, never silently dropped
        # (a TLS or password setting that does nothing would be worse than an error)
        _check(key not in _ETCD_ONLY_KEYS,
               f"--rdzv-conf: {key} is a key of --rdzv-backend etcd, not c10d")
        if key in ("close_timeout", "read_timeout", "is_host"):
            own[key] = value
        else:
            passed.append(f"{key}={value}")
    return own, ",".join(passed), read.warnings


def _positive(key: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise RendezvousConfigError(f"--rdzv-conf: {key}={raw!r} is not a number") from None
    _check(0 < value < math.inf, f"--rdzv-conf: {key} must be positive, got {raw!r}")
    return value


def _boolean(key: str, raw: str) -> bool:
    word = raw.lower()
    _check(word in _TRUE + _FALSE, f"--rdzv-conf: {key}={raw!r} is not a boolean")
    return word in _TRUE


def make_c10d_config(*, endpoint: str, run_id: str, nnodes: str, rdzv_conf: str = "",
                     local_addr: str | None = None) -> C10dConfig:
    """Build the config from torchrun's flags; raises ``RendezvousConfigError``.

    ``read_timeout`` (torchrun: the store's read timeout) becomes ``outage_limit``, how long
    the host may be unreachable before a node gives up, unless ``outage_limit`` is given;
    without either it is the lease TTL, so it is always finite."""
    host, port = parse_endpoint(endpoint)
    own, passed, warnings = _split_conf(rdzv_conf)
    _check(port != 0 or nnodes.strip() in ("1", "1:1"),
           f"--rdzv-endpoint: port 0 ({endpoint!r}) is for one node only, got --nnodes {nnodes}")
    conf = make_config(endpoint=f"{bracket(host)}:{port}", run_id=run_id, nnodes=nnodes,
                       rdzv_conf=passed, local_addr=local_addr)
    limit = conf.outage_limit
    if limit is None:
        limit = _positive("read_timeout", own["read_timeout"]) if "read_timeout" in own \
            else float(conf.lease_ttl)
    etcd = replace(conf, outage_limit=limit,
                   service=f"the rendezvous host {bracket(host)}:{port}")
    _check_tls(etcd)
    close = _positive("close_timeout", own["close_timeout"]) if "close_timeout" in own else 30.0
    is_host = _boolean("is_host", own["is_host"]) if "is_host" in own else None
    # after the checks: a bad value is one line, not two (unknown keys are ignored, as
    # torchrun ignores them, with a warning)
    for warning in warnings:
        logger.warning("%s", warning)
    return C10dConfig(host, port, is_host, close, etcd, local_addr or None)


def _check_tls(conf: EtcdRendezvousConfig) -> None:
    """The host serves with ``cert``/``key`` and admits clients signed by ``cacert``, so a
    secured c10d job needs all three; a password only ever crosses TLS."""
    tls = conf.tls
    if tls is not None:
        missing = [k for k in ("cacert", "cert", "key") if getattr(tls, k) is None]
        _check(not missing, f"--rdzv-conf: c10d with TLS needs cacert=, cert= and key= "
                            f"(the host serves with cert/key and admits the clients cacert "
                            f"signed); missing {', '.join(k + '=' for k in missing)}")
    _check(conf.user is None or tls is not None,
           "--rdzv-conf: c10d user= needs TLS (cacert=, cert=, key=): a password never "
           "crosses the network in clear")
    _check(conf.user is None or conf.password is not None,
           "--rdzv-conf: c10d user= needs password_file=")
