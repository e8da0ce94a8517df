"""Real etcd servers for tests: one member or a 3-member cluster on free loopback ports.

``EtcdFactory`` starts members with a fresh data dir each and fast raft timings, waits
until ``/health`` answers (the one acceptable poll: waiting for a server to come up),
and stops everything it started: SIGTERM, then SIGKILL after 5 s.

Missing ``etcd`` skips the test, or fails it under ELASTIC_SUPERVISOR_REQUIRE_DEPS=1
(``.ci/run`` installs etcd-server and sets it): see tests/support/deps.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import deps
from tests.support.ports import free_port

HEALTH_TIMEOUT = 15.0
STOP_GRACE = 5.0
PORT_ATTEMPTS = 3  # cluster starts before a port taken meanwhile fails the test


def etcd_binary() -> str:
    """Path of ``etcd``; skip (or fail under .ci/run) when it is not installed."""
    return deps.need_binary("etcd")


@dataclass(frozen=True)
class TlsMaterial:
    """A throwaway CA plus server and client certificates for 127.0.0.1."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_tls_material(directory: Path, *, common_names: bool = True) -> TlsMaterial:
    """Create the CA and certificates with the ``openssl`` CLI (skip if missing).

    ``common_names=False``: the server and client certificates carry no CN (etcd 3.4's JSON
    gateway refuses a client certificate with a CN once user auth is on)."""
    deps.need_binary("openssl", "apt-get install openssl")
    directory.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ca, ca_key = directory / "ca.crt", directory / "ca.key"
    _openssl("req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "1", "-subj", "/CN=ca")
    certs = {}
    for name in ("server", "client"):
        key, csr, crt = (directory / f"{name}.{ext}" for ext in ("key", "csr", "crt"))
        ext_file = directory / f"{name}.ext"
        ext_file.write_text("subjectAltName=IP:127.0.0.1\n")
        subject = f"/CN={name}" if common_names else f"/O=elastic-supervisor tests/OU={name}"
        _openssl("req", *ec, "-keyout", key, "-out", csr, "-subj", subject)
        _openssl("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
                 "-out", crt, "-days", "1", "-extfile", ext_file)
        certs[name] = (crt, key)
    return TlsMaterial(ca, *certs["server"], *certs["client"])


def _openssl(*args: object) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


@dataclass
class EtcdMember:
    """One etcd process; ``endpoint`` is its client URL."""

    name: str
    data_dir: Path
    client_port: int
    peer_port: int
    cluster: str = ""  # --initial-cluster value
    token: str = "solo"  # --initial-cluster-token, shared by one cluster's members
    tls: TlsMaterial | None = None
    # --election-timeout; the heartbeat is a fifth of it, etcd's smallest ratio: a member
    # ticks once per heartbeat, and a 3-member cluster idles at 0.11 CPU-s/s with a 20 ms
    # heartbeat against 0.21 with 10 ms (the suite is CPU-bound)
    election_ms: int = 100
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def command(self) -> list[str]:
        cmd = [
            etcd_binary(), "--name", self.name, "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
            "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self.cluster or f"{self.name}={self.peer_url}",
            "--initial-cluster-token", self.token,
            "--heartbeat-interval", str(self.election_ms // 5),
            "--election-timeout", str(self.election_ms),
        ]
        if self.tls:
            cmd += ["--cert-file", str(self.tls.server_cert), "--key-file",
                    str(self.tls.server_key), "--trusted-ca-file", str(self.tls.ca),
                    "--client-cert-auth"]
        return cmd

    def start(self) -> None:
        """Start (or restart, keeping the data dir and ports) without waiting."""
        log = open(self.data_dir.with_suffix(".log"), "ab")  # noqa: SIM115 - child owns it
        with log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=log)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after the grace; reap."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(STOP_GRACE)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def kill(self) -> None:
        """SIGKILL at once (a crash)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def is_healthy(self) -> bool:
        if self.tls:
            return self._tls_healthy()
        try:
            with urllib.request.urlopen(self.endpoint + "/health", timeout=1) as resp:
                return bool(json.load(resp).get("health") == "true")
        except (OSError, ValueError):
            return False

    def _tls_healthy(self) -> bool:
        assert self.tls is not None
        result = subprocess.run(
            ["etcdctl", "--endpoints", self.endpoint, "--cacert", str(self.tls.ca), "--cert",
             str(self.tls.client_cert), "--key", str(self.tls.client_key),
             "--command-timeout=1s", "endpoint", "health"],
            capture_output=True, check=False,
        )
        return result.returncode == 0

    def wait_healthy(self, timeout: float = HEALTH_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not self.is_healthy():
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"etcd {self.name} exited: {self._log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd {self.name} not healthy in {timeout}s: "
                                   f"{self._log_tail()}")
            time.sleep(0.02)

    def _log_tail(self) -> str:
        log = self.data_dir.with_suffix(".log")
        return log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"


class EtcdFactory:
    """Starts etcd members under ``base_dir``; ``close()`` stops all of them."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir
        self.members: list[EtcdMember] = []
        self._made = 0  # members ever made: each gets a data dir of its own

    def _member(self, name: str, tls: TlsMaterial | None = None) -> EtcdMember:
        data_dir = self.base_dir / f"etcd-{self._made}-{name}"
        self._made += 1
        member = EtcdMember(name, data_dir, free_port(), free_port(), tls=tls)
        self.members.append(member)
        return member

    def single(self, tls: TlsMaterial | None = None) -> EtcdMember:
        """One healthy member."""
        return self._healthy(lambda: [self._member("solo", tls)])[0]

    def cluster(self, size: int = 3, election_ms: int = 100) -> list[EtcdMember]:
        """``size`` members forming one cluster, all healthy (``election_ms``: their
        election timeout; etcd's default is 1000)."""

        def make() -> list[EtcdMember]:
            members = [self._member(f"m{i}") for i in range(size)]
            spec = ",".join(f"{m.name}={m.peer_url}" for m in members)
            for member in members:
                member.cluster, member.token = spec, f"cluster-{members[0].peer_port}"
                member.election_ms = election_ms
            return members

        return self._healthy(make)

    def _healthy(self, make: Callable[[], list[EtcdMember]]) -> list[EtcdMember]:
        """Start the members ``make`` returns; wait until all are healthy.

        ``free_port`` picks ports etcd binds only later; meanwhile one may be taken (an
        outgoing connection gets it as its source port, e.g. another member's dial), and
        that member exits "address already in use". Then all of them start again, on new
        ports and data dirs."""
        for attempt in range(PORT_ATTEMPTS):
            members = make()
            for member in members:
                member.start()
            try:
                for member in members:
                    member.wait_healthy()
            except RuntimeError as exc:
                if "address already in use" not in str(exc) or attempt == PORT_ATTEMPTS - 1:
                    raise
                for member in members:
                    member.kill()
                    self.members.remove(member)
            else:
                return members
        raise AssertionError("unreachable")

    def close(self) -> None:
        for member in self.members:
            member.stop()


@contextmanager
def etcd_factory(base_dir: Path) -> Iterator[EtcdFactory]:
    """An ``EtcdFactory`` that stops every member it started on exit."""
    etcd_binary()
    factory = EtcdFactory(base_dir)
    try:
        yield factory
    finally:
        factory.close()


def endpoints(members: Sequence[EtcdMember]) -> tuple[str, ...]:
    return tuple(m.endpoint for m in members)


def member_status(member: EtcdMember) -> dict[str, object]:
    """The member's ``/v3/maintenance/status`` answer (raft leader, its own id)."""
    request = urllib.request.Request(member.endpoint + "/v3/maintenance/status", data=b"{}",
                                     method="POST")
    with urllib.request.urlopen(request, timeout=1) as resp:
        return dict(json.load(resp))


def has_leader(member: EtcdMember) -> bool:
    return int(str(member_status(member).get("leader", 0))) != 0


def is_leader(member: EtcdMember) -> bool:
    status = member_status(member)
    header = status.get("header")
    own = header.get("member_id") if isinstance(header, dict) else None
    return own is not None and str(status.get("leader")) == str(own)


def freeze(member: EtcdMember) -> None:
    """SIGSTOP: the member goes silent, its sockets stay open, nothing is refused."""
    assert member.process is not None
    member.process.send_signal(signal.SIGSTOP)


def thaw(member: EtcdMember) -> None:
    assert member.process is not None
    member.process.send_signal(signal.SIGCONT)
