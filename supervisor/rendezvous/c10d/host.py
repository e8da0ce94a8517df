"""The etcd a c10d host runs as its child: who hosts (torchrun's rule), the
single-member etcd's command line, start, health, user auth and stop."""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import anyio

from supervisor.rendezvous.base import (
    RendezvousError,
)
from supervisor.rendezvous.c10d.access import (
    LoopbackTls,
    enable_auth,
)
from supervisor.rendezvous.c10d.config import C10dConfig, bracket
from supervisor.rendezvous.etcd.wire.client import EtcdClient, EtcdError, EtcdUnavailable

logger = logging.getLogger("supervisor.rendezvous.c10d")  # the backend's lines, whichever module

STARTUP_TIMEOUT = 30.0  # seconds the hosted etcd may take to become healthy
STOP_GRACE = 5.0
AUTH_GRACE = 2.0  # seconds a hosted etcd with auth on may refuse us before that is final
AUTH_REFUSED = (
    "c10d: the hosted etcd refuses this supervisor once user auth is on ({exc}); etcd 3.4's "
    "JSON gateway refuses client certificates that carry a Common Name when auth is "
    "enabled: use certificates without a CN (docs/rendezvous.md)"
)


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
        listen = [f"{self.scheme}://{bracket(ip)}:{cfg.port}" for ip in ips]
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
        """A client of the private loopback URL (with the job's user once auth is on).
        Its requests get the job's ``request_timeout``, as the rendezvous's do: with user
        auth, ``user/add`` and every ``authenticate`` run bcrypt on the server (etcd's
        cost 10: a tenth of a second of CPU, over 0.5 s on a busy 2-core machine)."""
        tls = self.config.etcd.tls
        loopback = LoopbackTls(tls.cacert, tls.cert, tls.key) if tls is not None else None
        etcd = self.config.etcd
        return EtcdClient([self.private], timeout=etcd.request_timeout, tls=loopback,
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
