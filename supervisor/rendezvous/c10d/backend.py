"""``--rdzv-backend c10d``: torchrun's multi-node command line, backed by a real etcd.

torchrun's c10d backend needs no server set up beforehand: the agent on the endpoint's
host serves a TCPStore and the others connect to it. Here the supervisor on that host
starts a single-member etcd as its child instead, and every node, the host included, runs
the etcd rendezvous (``supervisor.rendezvous.etcd.backend``) against it, so scale-up by watch, node
loss by lease, graceful leave, the job-wide restart budget and the exit barrier all work.

Who hosts is decided as torchrun decides (``_create_tcp_store``): ``is_host`` in
``--rdzv-conf`` if given, else whether the endpoint's host names this machine (``localhost``,
a loopback address, this host's name, FQDN or one of its addresses). A would-be host whose
port is taken (several supervisors on one machine all match) joins as a client, as does
one whose etcd loses the race to bind it.

The etcd child listens on the endpoint's port at the IP address the endpoint's host
resolves to (etcd refuses host names in listen URLs) and advertises the endpoint as given;
a second client URL on a free loopback port tells this supervisor that the server which
answers is its own; the peer URL is on loopback; the data directory is fresh, in the
runtime directory. It runs in its own session (a Ctrl-C on the terminal reaches the
supervisors, which leave cleanly, before it) under the workers' death-signal wrapper, so
the kernel kills it if the supervisor is SIGKILLed; otherwise it is stopped (TERM, then
KILL) when the supervisor closes the rendezvous.

The job depends on the hosting node, as with torchrun's c10d. When the host is gone, the
other nodes see an etcd outage; unlike an external cluster (which may come back), a lost
host does not, so c10d always gives up after a finite ``outage_limit``: ``read_timeout``
if given, else the lease TTL (10 s by default).
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import logging
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import anyio
from anyio.abc import TaskStatus

from supervisor.core.nodehealth import Limits
from supervisor.core.peers import PeerCheck
from supervisor.rendezvous.base import (
    BarrierResult,
    Capabilities,
    EtcdService,
    NodeLedger,
    RendezvousClosed,
    RendezvousError,
    RendezvousResult,
)
from supervisor.rendezvous.c10d.access import (
    ListenPlan,
    LoopbackTls,
    check_port_owner,
    enable_auth,
    listen_plan,
)
from supervisor.rendezvous.conf import read_conf
from supervisor.rendezvous.etcd.agent import EventHook
from supervisor.rendezvous.etcd.backend import EtcdRendezvous
from supervisor.rendezvous.etcd.config import (
    EtcdRendezvousConfig,
    RendezvousConfigError,
    make_config,
)
from supervisor.rendezvous.etcd.wire.client import EtcdClient, EtcdError, EtcdUnavailable
from supervisor.rendezvous.static import StaticRendezvous

logger = logging.getLogger("supervisor.rendezvous.c10d")  # the backend's lines, whichever module

DEFAULT_PORT = 29400  # torchrun's c10d default
STARTUP_TIMEOUT = 30.0  # seconds the hosted etcd may take to become healthy
STOP_GRACE = 5.0
PROBE_TIMEOUT = 1.0
ETCD_MISSING = (
    "c10d: this node hosts the rendezvous at {endpoint} but the etcd binary is not on PATH "
    "(Debian/Ubuntu: apt-get install etcd-server), or use --rdzv-backend etcd with an "
    "existing etcd cluster"
)

AUTH_GRACE = 2.0  # seconds a hosted etcd with auth on may refuse us before that is final
AUTH_REFUSED = (
    "c10d: the hosted etcd refuses this supervisor once user auth is on ({exc}); etcd 3.4's "
    "JSON gateway refuses client certificates that carry a Common Name when auth is "
    "enabled: use certificates without a CN (docs/rendezvous.md)"
)

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
        return f"{_bracket(self.host)}:{self.port}"


def _bracket(host: str) -> str:
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
    conf = make_config(endpoint=f"{_bracket(host)}:{port}", run_id=run_id, nnodes=nnodes,
                       rdzv_conf=passed, local_addr=local_addr)
    limit = conf.outage_limit
    if limit is None:
        limit = _positive("read_timeout", own["read_timeout"]) if "read_timeout" in own \
            else float(conf.lease_ttl)
    etcd = replace(conf, outage_limit=limit,
                   service=f"the rendezvous host {_bracket(host)}:{port}")
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


# ---------------------------------------------------------------------- who hosts


def matches_this_machine(host: str) -> bool:
    """torchrun's ``_matches_machine_hostname``: ``localhost``, a loopback address, this
    host's name or FQDN, or an address this host's name resolves to."""
    if host == "localhost":
        return True
    try:
        addr: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
    except ValueError:
        addr = None
    if addr is not None and addr.is_loopback:
        return True
    this = socket.gethostname()
    if host in (this, socket.getfqdn()):
        return True
    theirs = {ip for _, ip in _addrinfo(host)}
    return any(canon == host or ip in theirs or (addr is not None and ip == str(addr))
               for canon, ip in _addrinfo(this))


def _addrinfo(host: str) -> list[tuple[str, str]]:
    """(canonical name, IP address) pairs ``host`` resolves to; none if it does not."""
    try:
        found = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP,
                                   flags=socket.AI_CANONNAME)
    except (OSError, UnicodeError):
        return []
    return [(canon, str(sockaddr[0])) for _, _, _, canon, sockaddr in found]


def port_is_free(ip: str, port: int) -> bool:
    """Whether ``ip:port`` can be bound now (with SO_REUSEADDR, as etcd binds)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((ip, port))
        except OSError:
            return False
    return True


def _free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# ---------------------------------------------------------------------- the etcd child


class HostedEtcd:
    """The single-member etcd this supervisor hosts: start, wait until healthy, stop."""

    def __init__(self, binary: str, config: C10dConfig, runtime_dir: Path) -> None:
        self.binary = binary
        self.config = config
        tag = f"{os.getpid()}-{secrets.token_hex(3)}"
        self.name = f"c10d-{tag}"
        self.data_dir = runtime_dir / f"c10d-etcd-{tag}"
        self.log_path = runtime_dir / f"c10d-etcd-{tag}.log"
        self.scheme = "https" if config.secured else "http"
        self.private = f"{self.scheme}://127.0.0.1:{_free_loopback_port()}"  # ours alone
        self.peer = f"http://127.0.0.1:{_free_loopback_port()}"
        self.auth_on = False  # etcd's user auth is enabled (user= in --rdzv-conf)
        self._kept = False  # stopped to serve more addresses: start on the same data
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def command(self, ips: Sequence[str]) -> list[str]:
        """etcd's command line, serving ``ips`` (none: the private loopback URL only)."""
        cfg = self.config
        listen = [f"{self.scheme}://{_bracket(ip)}:{cfg.port}" for ip in ips]
        argv = [
            self.binary, "--name", self.name, "--data-dir", str(self.data_dir),
            "--listen-client-urls", ",".join([*listen, self.private]),
            "--advertise-client-urls", f"{self.scheme}://{cfg.endpoint}",
            "--listen-peer-urls", self.peer, "--initial-advertise-peer-urls", self.peer,
            "--initial-cluster", f"{self.name}={self.peer}", "--initial-cluster-token", self.name,
            "--initial-cluster-state", "new",
            # one member, no peers: only the first election waits for the timeout; the
            # member ticks once per heartbeat all job long (20 ms, etcd's smallest ratio to
            # the timeout: idle 0.014 CPU-s/s, against 0.028 at 10 ms)
            "--heartbeat-interval", "20", "--election-timeout", "100",
            "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn",
        ]
        tls = cfg.etcd.tls
        if tls is not None:  # client certificates from the first request on
            argv += ["--cert-file", str(tls.cert), "--key-file", str(tls.key),
                     "--trusted-ca-file", str(tls.cacert), "--client-cert-auth"]
        return argv

    def start(self, ips: Sequence[str], *, fresh: bool = True) -> None:
        from supervisor.workers.spawn import DeathSignal

        if fresh:
            shutil.rmtree(self.data_dir, ignore_errors=True)  # never an old job's keys
        argv = [*DeathSignal().prefix(), *self.command(ips)]
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, close_fds=True,
                start_new_session=True,  # a terminal's Ctrl-C reaches the supervisors first
            )
        where = ", ".join(f"{ip}:{self.config.port}" for ip in ips) or "loopback (private)"
        logger.info("c10d: started etcd (pid %d) for %s, listening on %s", self.popen.pid,
                    self.config.endpoint, where)

    def client(self) -> EtcdClient:
        """A client of the private loopback URL (with the job's user once auth is on)."""
        tls = self.config.etcd.tls
        loopback = LoopbackTls(tls.cacert, tls.cert, tls.key) if tls is not None else None
        etcd = self.config.etcd
        return EtcdClient([self.private], timeout=0.5, tls=loopback,
                          user=etcd.user if self.auth_on else None,
                          password=etcd.password if self.auth_on else None)

    async def wait_healthy(self) -> bool:
        """True once this server answers a read; False if it exited first. Polls: the one
        place where waiting for a server to come up has nothing to wait on."""
        assert self.popen is not None
        refused_since: float | None = None
        async with self.client() as client:
            with anyio.fail_after(STARTUP_TIMEOUT):
                while self.popen.poll() is None:
                    try:
                        await client.get("/elastic-supervisor/c10d-health")
                        return True
                    except EtcdUnavailable:
                        pass  # not listening yet
                    except EtcdError as exc:
                        # up, and refusing us: after a short grace (a member that just
                        # restarted may answer oddly once), waiting cannot help
                        now = time.monotonic()
                        refused_since = now if refused_since is None else refused_since
                        if self.auth_on and now - refused_since > AUTH_GRACE:
                            raise RendezvousError(AUTH_REFUSED.format(exc=exc)) from None
                    await anyio.sleep(0.02)
        return False

    async def enable_auth(self) -> None:
        """etcd's user auth on (through the private URL; the server serves nothing else
        yet), then ``auth_on``."""
        etcd = self.config.etcd
        assert etcd.user is not None and etcd.password is not None
        async with self.client() as client:
            await enable_auth(client, etcd.user, etcd.password)
        self.auth_on = True
        logger.info("c10d: etcd user auth enabled for user %s", etcd.user)

    async def start_on_spawner(self, ips: Sequence[str]) -> None:
        """``start`` on the spawner thread (its death signal: ``spawn.Spawner``), keeping
        the data of a server stopped by ``stop_keeping_data``."""
        from supervisor.workers.spawn import SPAWNER

        await SPAWNER.spawn(functools.partial(self.start, ips, fresh=not self._kept))

    async def stop_keeping_data(self) -> None:
        """Stop the server; the next start keeps its data (the auth just enabled)."""
        popen, self.popen = self.popen, None
        if popen is not None:
            with anyio.CancelScope(shield=True):
                await _terminate(popen)
        self._kept = True
        # a fresh private port: the old one is free for anyone until the restart binds it
        # (the peer URL must stay: the member's data names it)
        self.private = f"{self.scheme}://127.0.0.1:{_free_loopback_port()}"

    def failure(self) -> str:
        """The last line of the server's log (why it exited)."""
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            lines = []
        return lines[-1][:300] if lines else "no output"

    async def other_leases(self, max_ttl: int) -> int:
        """How many nodes' leases the server holds (every live node holds one, of at most
        ``max_ttl`` seconds; the node health records' leases last their window)."""
        async with self.client() as client:
            data = await client.call("/v3/lease/leases", {})
            count = 0
            for lease in data.get("leases") or []:
                info = await client.call("/v3/lease/timetolive", {"ID": lease.get("ID")})
                count += int(info.get("grantedTTL", 0)) <= max_ttl
        return count

    async def stop(self) -> None:
        """TERM, then KILL after the grace; reap; remove the data directory."""
        popen, self.popen = self.popen, None
        if popen is not None:
            with anyio.CancelScope(shield=True):
                await _terminate(popen)
        shutil.rmtree(self.data_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.log_path.unlink()


async def _terminate(popen: subprocess.Popen[bytes]) -> None:
    if popen.poll() is not None:
        return
    popen.send_signal(signal.SIGTERM)
    fd = os.pidfd_open(popen.pid)
    try:
        with anyio.move_on_after(STOP_GRACE):
            await anyio.wait_readable(fd)
        if popen.poll() is None:
            popen.kill()
            await anyio.wait_readable(fd)
    finally:
        os.close(fd)
    popen.wait()


# ---------------------------------------------------------------------- the backend


class _LostTheRace(Exception):
    """Another supervisor of ours bound the port first: join it as a client."""


class C10dRendezvous:
    """The ``Rendezvous`` for ``--rdzv-backend c10d``: maybe host etcd, then the etcd
    rendezvous against it. Errors that come from losing the host say so."""

    backend = "c10d"
    capabilities = Capabilities(membership_can_change=True, coordinates_nodes=True,
                                job_status=True)

    def __init__(self, config: C10dConfig, runtime_dir: Path,
                 etcd_binary: str | None = None, *, on_event: EventHook | None = None) -> None:
        self.config = config
        self.run_id = config.etcd.run_id
        self.runtime_dir = runtime_dir
        self.etcd_binary = etcd_binary if etcd_binary is not None else shutil.which("etcd")
        self.server: HostedEtcd | None = None
        self.inner = EtcdRendezvous(config.etcd, on_event=on_event)
        self._job_over = False  # this node saw the job end for everyone: linger as host
        self._left = False

    @property
    def server_pid(self) -> int | None:
        """The hosted etcd's pid (None on a client node): not a stray to sweep."""
        return self.server.pid if self.server is not None else None

    def extra_pids(self) -> list[int]:
        pid = self.server_pid
        return [pid] if pid is not None else []

    def etcd_service(self) -> EtcdService:
        return self.inner

    async def connect(self) -> None:
        """Host etcd if this node is the host, then take a lease (retried until
        ``join_timeout`` while the host's etcd is not up yet)."""
        if self.server is None and await self._should_host():
            await self._host()
        async with self._naming_the_host("could not reach"):
            await self.inner.connect()

    async def _should_host(self) -> bool:
        cfg = self.config
        wanted = cfg.is_host
        if wanted is None:
            wanted = await anyio.to_thread.run_sync(matches_this_machine, cfg.host)
        if not wanted:
            return False
        plan = await self._listen_plan()
        if cfg.is_host is None and not all(port_is_free(ip, cfg.port) for ip in plan.ips):
            self._check_port_owner()
            logger.info("c10d: %s is taken by this user: another supervisor hosts, joining "
                        "it as a client", cfg.endpoint)
            return False
        if self.etcd_binary is None:
            raise RendezvousError(ETCD_MISSING.format(endpoint=cfg.endpoint))
        return True

    def _check_port_owner(self) -> None:
        check_port_owner(self.config.endpoint, self.config.port)

    async def _host(self) -> None:
        """Start the etcd child; join as a client if another process of ours bound the
        port first. With user auth, the server first serves its private loopback URL
        only, until auth is on, then the public addresses."""
        assert self.etcd_binary is not None
        cfg = self.config
        plan = await self._listen_plan()
        logger.info("c10d: the hosted etcd binds %s (%s)", ", ".join(plan.ips), plan.why)
        server = HostedEtcd(self.etcd_binary, cfg, self.runtime_dir)
        self.server = server
        try:
            if cfg.etcd.user is not None:
                await self._start(server, ())
                await self._until_healthy(server, plan)
                await self._naming_auth(server.enable_auth())
                await server.stop_keeping_data()
            await self._start(server, plan.ips)
            await self._until_healthy(server, plan)
        except _LostTheRace:
            await self._drop_server()
            return
        except BaseException:
            await self._drop_server()
            raise
        logger.info("c10d: this node hosts the rendezvous at %s", cfg.endpoint)
        if not cfg.secured:
            logger.warning(
                "c10d: the rendezvous at %s has no authentication: %s can read and change "
                "the job (the workers' MASTER_ADDR included); give --rdzv-conf "
                "cacert=,cert=,key= (docs/security.md)", cfg.endpoint,
                "any local user" if plan.loopback_only else "anyone who reaches the port")

    async def _start(self, server: HostedEtcd, ips: Sequence[str]) -> None:
        try:
            await server.start_on_spawner(ips)
        except OSError as exc:
            raise RendezvousError(f"c10d: cannot start {self.etcd_binary}: {exc}") from None

    async def _until_healthy(self, server: HostedEtcd, plan: ListenPlan) -> None:
        cfg = self.config
        try:
            healthy = await server.wait_healthy()
        except TimeoutError:
            raise RendezvousError(f"c10d: the etcd for {cfg.endpoint} was not healthy within "
                                  f"{STARTUP_TIMEOUT:g}s: {server.failure()}") from None
        if healthy:
            return
        reason = server.failure()
        if cfg.is_host is None and not all(port_is_free(ip, cfg.port) for ip in plan.ips):
            self._check_port_owner()
            logger.info("c10d: another supervisor bound %s first, joining it as a client",
                        cfg.endpoint)
            raise _LostTheRace
        raise RendezvousError(f"c10d: the etcd for {cfg.endpoint} exited: {reason}")

    async def _naming_auth(self, step: Awaitable[None]) -> None:
        try:
            await step
        except EtcdError as exc:
            raise RendezvousError(f"c10d: cannot enable etcd user auth on the hosted etcd: "
                                  f"{exc}") from None

    async def _listen_plan(self) -> ListenPlan:
        return await anyio.to_thread.run_sync(listen_plan, self.config.host,
                                              self.config.local_addr)

    async def _drop_server(self) -> None:
        if self.server is not None:
            await self.server.stop()
            self.server = None

    @asynccontextmanager
    async def _naming_the_host(self, what: str = "lost") -> AsyncIterator[None]:
        """Re-raise a rendezvous error as the host's loss when nothing answers there."""
        try:
            yield
        except RendezvousClosed:
            raise
        except RendezvousError as exc:
            if await self._host_answers():
                raise
            where = "this node's" if self.server is not None else "the"
            # the cause is the host, said once: the client's error would repeat the outage line
            logger.debug("the rendezvous host does not answer: %s", exc)
            raise RendezvousError(
                f"{what} {where} c10d rendezvous host {self.config.endpoint}: nothing answers "
                f"there (outage_limit {self.config.etcd.outage_limit:g}s)") from exc

    async def _host_answers(self) -> bool:
        try:
            with anyio.fail_after(PROBE_TIMEOUT):
                stream = await anyio.connect_tcp(self.config.host, self.config.port)
        except (OSError, TimeoutError):
            return False
        await stream.aclose()
        return True

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The etcd rendezvous's lease upkeep."""
        await self.inner.run(task_status=task_status)

    async def next_round(self, local_world_size: int) -> RendezvousResult:
        async with self._naming_the_host():
            return await self.inner.next_round(local_world_size)

    async def wait_membership_change(self, result: RendezvousResult) -> str:
        async with self._naming_the_host():
            return await self.inner.wait_membership_change(result)

    async def record_failure_restart(self, message: str) -> int:
        async with self._naming_the_host():
            return await self.inner.record_failure_restart(message)

    async def restart_count(self) -> int:
        async with self._naming_the_host():
            return await self.inner.restart_count()

    async def exit_barrier(self, result: RendezvousResult, timeout: float) -> BarrierResult:
        verdict = await self.inner.exit_barrier(result, timeout)
        self._job_over = verdict.ok
        return verdict

    async def fail_job(self, message: str) -> None:
        self._job_over = True
        async with self._naming_the_host():
            await self.inner.fail_job(message)

    async def leave(self, *, tell_peers: bool = True) -> None:
        """Revoke this node's lease; at once if the host is gone (nothing to tell), rather
        than retrying for ``request_timeout`` as against a cluster that may come back."""
        if self._left:
            return
        self._left = True
        gone = self.server is None and not await self._host_answers()
        with anyio.move_on_after(PROBE_TIMEOUT if gone else math.inf):
            await self.inner.leave(tell_peers=tell_peers and not gone)

    def node_ledger(self, limits: Limits) -> NodeLedger:
        return self.inner.node_ledger(limits)

    async def check_peers(self, result: RendezvousResult, within: float) -> PeerCheck:
        """As the etcd backend's (the host's etcd may be gone with it: then the health
        endpoints alone tell)."""
        return await self.inner.check_peers(result, within)

    async def serve_until_job_ends(self) -> None:
        """As host: until the job is over for everyone (a host that quarantined itself
        keeps serving, without workers: the other nodes depend on its etcd)."""
        if self.server is None:
            return
        logger.info("c10d: this node left the job but keeps serving the rendezvous at %s "
                    "until the job ends", self.config.endpoint)
        await self.inner.wait_job_closed()
        self._job_over = True

    async def aclose(self) -> None:
        """Close the etcd rendezvous; as host, give the other nodes up to ``close_timeout``
        to see the job's end before the server goes (only when the job did end)."""
        await self.leave(tell_peers=False)
        await self.inner.aclose()
        if self.server is None:
            return
        if self._job_over:
            await self._linger()
        await self._drop_server()

    async def _linger(self) -> None:
        """Until no other node holds a lease (each revokes its own as it exits), bounded.
        A short poll: this runs once, at the very end, and leases cannot be watched."""
        assert self.server is not None
        with anyio.move_on_after(self.config.close_timeout):
            while True:
                try:
                    if await self.server.other_leases(self.config.etcd.lease_ttl) == 0:
                        return
                except EtcdError:
                    return
                await anyio.sleep(0.05)


def make_c10d_rendezvous(*, endpoint: str, run_id: str, nnodes: str, rdzv_conf: str,
                         local_addr: str | None, runtime_dir: Path, standalone: bool = False,
                         master_port: int | None = None, on_event: EventHook | None = None,
                         ) -> C10dRendezvous | StaticRendezvous:
    """The c10d backend from torchrun's flags; raises ``RendezvousConfigError``.

    ``--standalone`` or port 0 (torchrun's "stacked single-node" line,
    ``--rdzv-endpoint=localhost:0``) is one node with nothing to host: the static backend,
    which picks a fresh master port for every attempt."""
    if standalone:
        return StaticRendezvous(run_id, 1, 0, "127.0.0.1", master_port)
    config = make_c10d_config(endpoint=endpoint, run_id=run_id, nnodes=nnodes,
                              rdzv_conf=rdzv_conf, local_addr=local_addr)
    if config.port == 0:
        return StaticRendezvous(run_id, 1, 0, "127.0.0.1", master_port)
    return C10dRendezvous(config, runtime_dir, on_event=on_event)

