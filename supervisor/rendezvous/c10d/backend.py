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

import logging
import math
import shutil
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
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
    check_port_owner,
    listen_plan,
)
from supervisor.rendezvous.c10d.config import C10dConfig, make_c10d_config
from supervisor.rendezvous.c10d.host import (
    STARTUP_TIMEOUT,
    HostedEtcd,
    matches_this_machine,
    port_is_free,
)
from supervisor.rendezvous.etcd.agent import EventHook
from supervisor.rendezvous.etcd.backend import EtcdRendezvous
from supervisor.rendezvous.etcd.wire.client import EtcdError
from supervisor.rendezvous.static import StaticRendezvous

logger = logging.getLogger("supervisor.rendezvous.c10d")  # the backend's lines, whichever module

PROBE_TIMEOUT = 1.0
ETCD_MISSING = (
    "c10d: this node hosts the rendezvous at {endpoint} but the etcd binary is not on PATH "
    "(Debian/Ubuntu: apt-get install etcd-server), or use --rdzv-backend etcd with an "
    "existing etcd cluster"
)


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

