"""The rendezvous interface: how nodes agree on membership, ranks and the master address.

A backend is created once per supervisor (``registry.make_rendezvous``) and used by the
controller (rounds, the membership watch, the exit barrier); it declares what it can do
in ``capabilities``. ``static`` is the embedded default (no server); ``etcd`` and
``etcd-v2`` use etcd v3; ``c10d`` is etcd hosted by one supervisor.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import AsyncIterator
from typing import Any, Protocol

import msgspec
from anyio.abc import TaskStatus

from supervisor.core.jobstep import JobStep, ReportSource
from supervisor.core.nodehealth import Judgement, Limits, NodeFailure, Quarantine, RoundCause
from supervisor.core.peers import PeerCheck
from supervisor.errors import RendezvousError as RendezvousError


class RendezvousResult(msgspec.Struct, frozen=True):
    """One completed round: this node's place in the job."""

    round: int
    group_rank: int  # this node's rank among nodes (GROUP_RANK)
    group_world_size: int  # number of nodes (GROUP_WORLD_SIZE)
    rank_offset: int  # global RANK of this node's local rank 0
    world_size: int  # total workers over all nodes (WORLD_SIZE)
    master_addr: str
    master_port: int
    members: tuple[str, ...] = ()  # node ids in group-rank order
    duration: float = 0.0  # seconds the round took to complete
    spare: bool = False  # this node waited as a spare (beyond max nodes) before this round
    snapshot: JobStep | None = None  # the snapshot step the round decided (None: not decided)


def free_port(addr: str = "127.0.0.1") -> int:
    """A TCP port free on ``addr`` right now, for a round's rank-0 worker to bind soon."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind(sockaddr)
            port: int = sock.getsockname()[1]
    except OSError:  # not an address of this host: any interface will do
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
    return port


def hold_port(port: int = 0) -> socket.socket | None:
    """A socket that holds TCP ``port`` (0: a free one) on every address of this host,
    bound with ``SO_REUSEADDR`` and never listening; None if the port is taken.

    While it is open the kernel hands the port to no one (a ``bind`` to port 0, a
    connection's local port) and a ``bind`` without ``SO_REUSEADDR`` fails, but the
    rank-0 worker's store still binds and listens on it (torch's TCPStore sets
    ``SO_REUSEADDR``). A port only found free would stay up for grabs until rank 0 has
    imported torch and binds it: seconds, tens of them on a loaded machine, where
    torchrun's agent binds its store at once."""
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 here
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 too
            sock.bind((address, port))
            return sock
        except OSError:
            sock.close()
    return None


class BarrierResult(msgspec.Struct, frozen=True):
    ok: bool
    message: str = ""


class RendezvousClosed(RendezvousError):
    """The job was closed (succeeded or failed for good on some node)."""

    def __init__(self, message: str, *, succeeded: bool = False) -> None:
        super().__init__(message)
        self.succeeded = succeeded  # it ended well (a spare that was never needed: exit 0)


class Capabilities(msgspec.Struct, frozen=True):
    """What a backend can do, declared by it (never inferred from its name)."""

    membership_can_change: bool  # nodes may join or leave: another round may follow
    coordinates_nodes: bool  # success and failure are agreed with the other nodes
    job_status: bool  # keeps the job-wide status of every node (``status --rdzv-...``)


class Rendezvous(Protocol):
    """What the controller needs from a rendezvous backend."""

    backend: str
    run_id: str
    capabilities: Capabilities

    def extra_pids(self) -> list[int]:
        """Our children that belong to the backend (a c10d host's etcd): never swept as
        strays when a worker group stops."""
        ...

    def etcd_service(self) -> EtcdService | None:
        """The etcd rendezvous behind the backend (its outages, metrics, job-wide status),
        or None for a backend without etcd."""
        ...

    async def connect(self) -> None:
        """Reach the service once, so a bad endpoint fails before anything starts."""
        ...

    async def run(self, *, task_status: TaskStatus[None]) -> None:
        """Background upkeep (leases) for as long as the supervisor runs."""
        ...

    async def next_round(self, local_world_size: int) -> RendezvousResult:
        """Join the next round and wait until it completes; raise RendezvousError if it can't."""
        ...

    async def wait_membership_change(self, result: RendezvousResult) -> str:
        """Return (with a reason) once the round ``result`` is outdated: a node is waiting
        to join and capacity remains, a member was lost, or another node started a new
        round (for example after its own failure). Never returns for a static job."""
        ...

    async def record_failure_restart(self, message: str) -> int:
        """Count one failure restart job-wide; return the job-wide count so far."""
        ...

    async def restart_count(self) -> int:
        """The job-wide failure restart count (0 for a single node)."""
        ...

    async def check_peers(self, result: RendezvousResult, within: float) -> PeerCheck:
        """Which other members of round ``result`` are confirmed gone (``core.peers``), in
        at most ``within`` seconds; never raises (what it cannot tell is "unsure"). Used
        when a local rank fails: a failure that came from a lost peer is a membership
        change."""
        ...

    async def exit_barrier(self, result: RendezvousResult, timeout: float) -> BarrierResult:
        """Wait (bounded) until every node of the round finished its workers."""
        ...

    async def fail_job(self, message: str) -> None:
        """Tell every node the job failed for good (closes the rendezvous)."""
        ...

    async def leave(self, *, tell_peers: bool = True) -> None:
        """Leave gracefully (this node only); the job continues elsewhere. ``tell_peers``:
        a backend that can also tells the peers directly (False when the run is simply
        over and the connections are being closed)."""
        ...

    async def aclose(self) -> None:
        """Release connections and leases."""
        ...

    def node_ledger(self, limits: Limits) -> NodeLedger:
        """This node's health facts (root causes, failure record, quarantine)."""
        ...

    async def serve_until_job_ends(self) -> None:
        """After this node left: return once the other nodes no longer need anything from
        it (at once, except on a c10d host, whose etcd they depend on)."""
        ...


class PeerNotices(Protocol):
    """Leave notices peers send this node directly (``POST /v1/leave-notice``)."""

    counts: dict[str, int]  # notices by outcome: received, refused, confirmed, unconfirmed

    def receive(self, doc: object) -> tuple[int, dict[str, Any]]:
        """Judge one notice; the HTTP status and body to answer with."""
        ...


class TlsSettings(Protocol):
    """The TLS files a client of the service uses (``etcd.wire.client.TlsFiles``)."""

    def ssl_context(self) -> ssl.SSLContext: ...


class ServiceSettings(Protocol):
    """Where the backend's service is and how to reach it (``etcd.config``'s settings):
    what runs beside the rounds opens its own client with them."""

    @property
    def endpoints(self) -> tuple[str, ...]: ...

    @property
    def run_id(self) -> str: ...

    @property
    def local_addr(self) -> str: ...

    @property
    def request_timeout(self) -> float: ...

    @property
    def tls(self) -> TlsSettings | None: ...

    @property
    def user(self) -> str | None: ...

    @property
    def password(self) -> str | None: ...


class JobStatusStore(Protocol):
    """Where this node publishes its status summary (the job-wide view of ``status``):
    the service's settings, this node's id and the lease its summary is bound to."""

    @property
    def config(self) -> ServiceSettings: ...

    @property
    def node_id(self) -> str: ...

    @property
    def lease_id(self) -> int: ...


class Reachability(Protocol):
    """Whether the service answers, as its client last found out (monotonic times)."""

    @property
    def unreachable_since(self) -> float | None: ...  # the current outage began

    @property
    def outages(self) -> int: ...  # outages so far

    @property
    def total_outage(self) -> float: ...  # seconds unreachable over all finished outages

    def outage_age(self, now: float) -> float:
        """Seconds the current outage has lasted at ``now`` (0: none)."""
        ...


class OutageView(Protocol):
    """The service's reachability and traffic: /status's outage view, the metrics."""

    @property
    def reachability(self) -> Reachability: ...

    @property
    def stats(self) -> dict[str, int]: ...

    def outage_status(self) -> dict[str, Any]:
        """For ``/status``: whether the service answers, and the outages so far."""
        ...


class ControlValue(Protocol):
    """One control key as the service holds it."""

    @property
    def key(self) -> str: ...

    @property
    def value(self) -> bytes: ...

    @property
    def mod_revision(self) -> int: ...


class EtcdService(JobStatusStore, OutageView, Protocol):
    """The etcd behind an etcd-based backend (etcd, etcd-v2, c10d's hosted one), for what
    runs beside the rounds: the job's status summaries, /status's outage view, the etcd
    metrics and peers' leave notices."""

    snapshot_report: ReportSource | None  # what this node's snapshots hold, told at a join

    @property
    def notices(self) -> PeerNotices: ...

    async def put_control(self, name: str, value: str) -> None:
        """Put ``ctl/<name>`` (every agent's control watch brings it)."""
        ...

    def control_changes(self, name: str) -> AsyncIterator[ControlValue | None]:
        """``ctl/<name>`` now, then after each change of the control keys."""
        ...


class NodeLedger(Protocol):
    """Where a backend keeps a node's health facts (``core.nodehealth``): job-wide in etcd,
    in memory for the static backend. Every method may raise ``RendezvousError``-free
    errors of its transport; the caller bounds and logs them."""

    node: str  # this node's health id
    member: str  # its rendezvous member id
    # another node can take this one's place: a node failing its check waits (re-checking)
    # instead of ending the run with the quarantine exit code (the static backend: False)
    replaceable: bool

    @property
    def spare(self) -> bool:
        """This node waits beyond MAX nodes for a place (a warm spare)."""
        ...

    async def claim_root_cause(self, cause: RoundCause) -> RoundCause:
        """Record ``cause`` as its round's root cause unless another node did first;
        return the round's root cause."""
        ...

    async def record_failure(self, failure: NodeFailure) -> Judgement:
        """Count a failure whose root cause was this node's; the quarantine verdict."""
        ...

    async def quarantine(self, reason: str) -> None:
        """Mark this node quarantined (it stays out until an operator clears it)."""
        ...

    async def held(self) -> Quarantine | None:
        """This node's quarantine, if it is still held."""
        ...

    async def wait_cleared(self) -> None:
        """Return once this node's quarantine is cleared."""
        ...

    async def job_view(self) -> dict[str, Any]:
        """Every node's record (quarantined nodes, failures in the window), for /status."""
        ...
