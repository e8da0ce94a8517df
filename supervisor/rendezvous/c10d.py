"""``--rdzv-backend c10d``: torchrun's multi-node command line, backed by a real etcd.

torchrun's c10d backend needs no server set up beforehand: the agent on the endpoint's
host serves a TCPStore and the others connect to it. Here the supervisor on that host
starts a single-member etcd as its child instead, and every node, the host included, runs
the etcd rendezvous (``supervisor.rendezvous.etcd``) against it, so scale-up by watch, node
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
import ipaddress
import logging
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import anyio
from anyio.abc import TaskStatus

from supervisor.rendezvous.base import (
    BarrierResult,
    Capabilities,
    RendezvousClosed,
    RendezvousError,
    RendezvousResult,
)
from supervisor.rendezvous.conf import read_conf
from supervisor.rendezvous.etcd import (
    EtcdRendezvous,
    EtcdRendezvousConfig,
    EventHook,
    RendezvousConfigError,
    make_config,
)
from supervisor.rendezvous.etcd_client import EtcdClient, EtcdError
from supervisor.rendezvous.static import StaticRendezvous

logger = logging.getLogger(__name__)

DEFAULT_PORT = 29400  # torchrun's c10d default
STARTUP_TIMEOUT = 30.0  # seconds the hosted etcd may take to become healthy
STOP_GRACE = 5.0
PROBE_TIMEOUT = 1.0
ETCD_MISSING = (
    "c10d: this node hosts the rendezvous at {endpoint} but the etcd binary is not on PATH "
    "(Debian/Ubuntu: apt-get install etcd-server), or use --rdzv-backend etcd with an "
    "existing etcd cluster"
)

# --rdzv-conf keys: torchrun's c10d keys, then those of our etcd backend that apply here
_TORCHRUN_KEYS = ("join_timeout", "timeout", "last_call_timeout", "close_timeout",
                  "read_timeout", "is_host")
_ETCD_KEYS = ("lease_ttl", "exit_barrier_timeout", "request_timeout", "outage_limit",
              "node_id")
_ETCD_ONLY_KEYS = ("protocol", "cacert", "cert", "key", "user", "password_file")
_TRUE, _FALSE = ("1", "true", "t", "yes", "y"), ("0", "false", "f", "no", "n")


@dataclass(frozen=True)
class C10dConfig:
    """Settings of the c10d backend: the endpoint, who hosts, and the etcd rendezvous."""

    host: str
    port: int
    is_host: bool | None  # None: decide as torchrun does
    close_timeout: float
    etcd: EtcdRendezvousConfig

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


def _split_conf(text: str) -> tuple[dict[str, str], str]:
    """(c10d-only keys, the rest as ``k=v,...`` for the etcd backend's parser)."""
    own: dict[str, str] = {}
    passed: list[str] = []
    read = read_conf(text, _TORCHRUN_KEYS + _ETCD_KEYS + _ETCD_ONLY_KEYS, "c10d")
    for warning in read.warnings:  # unknown keys are ignored, as torchrun ignores them
        logger.warning("%s", warning)
    for key, value in read.items:
        # known, but meaningless for the hosted etcd: refused, never silently dropped
        # (a TLS or password setting that does nothing would be worse than an error)
        _check(key not in _ETCD_ONLY_KEYS,
               f"--rdzv-conf: {key} is a key of --rdzv-backend etcd, not c10d")
        if key in ("close_timeout", "read_timeout", "is_host"):
            own[key] = value
        else:
            passed.append(f"{key}={value}")
    return own, ",".join(passed)


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
    own, passed = _split_conf(rdzv_conf)
    _check(port != 0 or nnodes.strip() in ("1", "1:1"),
           f"--rdzv-endpoint: port 0 ({endpoint!r}) is for one node only, got --nnodes {nnodes}")
    conf = make_config(endpoint=f"{_bracket(host)}:{port}", run_id=run_id, nnodes=nnodes,
                       rdzv_conf=passed, local_addr=local_addr)
    limit = conf.outage_limit
    if limit is None:
        limit = _positive("read_timeout", own["read_timeout"]) if "read_timeout" in own \
            else float(conf.lease_ttl)
    etcd = replace(conf, outage_limit=limit)
    close = _positive("close_timeout", own["close_timeout"]) if "close_timeout" in own else 30.0
    is_host = _boolean("is_host", own["is_host"]) if "is_host" in own else None
    return C10dConfig(host, port, is_host, close, etcd)


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


def listen_ip(host: str) -> str:
    """The IP address etcd listens on: what ``host`` resolves to, IPv4 first.

    A name other than ``localhost`` that resolves only to loopback here is the machine's
    own name mapped to 127.0.x.1 in /etc/hosts (Debian does this), while the other nodes
    resolve it to a routable address: then every interface, as torchrun's store listens."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    found = [ip for _, ip in _addrinfo(host)]
    _check(bool(found), f"--rdzv-endpoint: cannot resolve {host!r}")
    if host != "localhost" and all(ipaddress.ip_address(ip).is_loopback for ip in found):
        return "0.0.0.0"
    return next((ip for ip in found if ":" not in ip), found[0])


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
        self.private = ""  # this server's own loopback client URL
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def command(self, ip: str) -> list[str]:
        cfg = self.config
        self.private = f"http://127.0.0.1:{_free_loopback_port()}"
        peer = f"http://127.0.0.1:{_free_loopback_port()}"
        return [
            self.binary, "--name", self.name, "--data-dir", str(self.data_dir),
            "--listen-client-urls", f"http://{_bracket(ip)}:{cfg.port},{self.private}",
            "--advertise-client-urls", f"http://{cfg.endpoint}",
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self.name}={peer}", "--initial-cluster-token", self.name,
            "--initial-cluster-state", "new",
            # one member, no peers: only the first election waits for these
            "--heartbeat-interval", "10", "--election-timeout", "100",
            "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn",
        ]

    def start(self, ip: str) -> None:
        from supervisor.workers.spawn import DeathSignal

        shutil.rmtree(self.data_dir, ignore_errors=True)  # fresh: never an old job's keys
        argv = [*DeathSignal().prefix(), *self.command(ip)]
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, close_fds=True,
                start_new_session=True,  # a terminal's Ctrl-C reaches the supervisors first
            )
        logger.info("c10d: started etcd (pid %d) for %s, listening on %s:%d",
                    self.popen.pid, self.config.endpoint, ip, self.config.port)

    async def wait_healthy(self) -> bool:
        """True once this server answers a read; False if it exited first. Polls: the one
        place where waiting for a server to come up has nothing to wait on."""
        assert self.popen is not None
        async with EtcdClient([self.private], timeout=0.5) as client:
            with anyio.fail_after(STARTUP_TIMEOUT):
                while self.popen.poll() is None:
                    with contextlib.suppress(EtcdError):
                        await client.get("/elastic-supervisor/c10d-health")
                        return True
                    await anyio.sleep(0.02)
        return False

    def failure(self) -> str:
        """The last line of the server's log (why it exited)."""
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            lines = []
        return lines[-1][:300] if lines else "no output"

    async def other_leases(self) -> int:
        """How many leases the server holds (every live node holds one)."""
        async with EtcdClient([self.private], timeout=0.5) as client:
            data = await client.call("/v3/lease/leases", {})
        return len(data.get("leases") or [])

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

    def etcd_service(self) -> EtcdRendezvous:
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
        ip = await self._listen_ip()
        if cfg.is_host is None and not port_is_free(ip, cfg.port):
            logger.info("c10d: %s is taken: another supervisor hosts, joining it as a client",
                        cfg.endpoint)
            return False
        if self.etcd_binary is None:
            raise RendezvousError(ETCD_MISSING.format(endpoint=cfg.endpoint))
        return True

    async def _host(self) -> None:
        """Start the etcd child; join as a client if another process bound the port first."""
        assert self.etcd_binary is not None
        cfg = self.config
        ip = await self._listen_ip()
        server = HostedEtcd(self.etcd_binary, cfg, self.runtime_dir)
        try:
            server.start(ip)
        except OSError as exc:
            raise RendezvousError(f"c10d: cannot start {self.etcd_binary}: {exc}") from None
        self.server = server
        try:
            healthy = await server.wait_healthy()
        except TimeoutError:
            reason = server.failure()
            await self._drop_server()
            raise RendezvousError(f"c10d: the etcd for {cfg.endpoint} was not healthy within "
                                  f"{STARTUP_TIMEOUT:g}s: {reason}") from None
        if healthy:
            logger.info("c10d: this node hosts the rendezvous at %s", cfg.endpoint)
            return
        reason = server.failure()
        await self._drop_server()
        if cfg.is_host is None and not port_is_free(ip, cfg.port):
            logger.info("c10d: another supervisor bound %s first, joining it as a client",
                        cfg.endpoint)
            return
        raise RendezvousError(f"c10d: the etcd for {cfg.endpoint} exited: {reason}")

    async def _listen_ip(self) -> str:
        try:
            return await anyio.to_thread.run_sync(listen_ip, self.config.host)
        except RendezvousConfigError as exc:
            raise RendezvousError(str(exc)) from None

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
            raise RendezvousError(
                f"{what} {where} c10d rendezvous host {self.config.endpoint} (nothing answers "
                f"there; outage_limit {self.config.etcd.outage_limit:g}s): {exc}") from exc

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

    async def leave(self) -> None:
        """Revoke this node's lease; at once if the host is gone (nothing to tell), rather
        than retrying for ``request_timeout`` as against a cluster that may come back."""
        if self._left:
            return
        self._left = True
        gone = self.server is None and not await self._host_answers()
        with anyio.move_on_after(PROBE_TIMEOUT if gone else math.inf):
            await self.inner.leave()

    async def aclose(self) -> None:
        """Close the etcd rendezvous; as host, give the other nodes up to ``close_timeout``
        to see the job's end before the server goes (only when the job did end)."""
        await self.leave()
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
                    if await self.server.other_leases() == 0:
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

