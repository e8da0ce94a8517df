"""The fork server's supervisor side: one preloaded interpreter per node that forks a
ready standby for a rank in milliseconds instead of each standby importing the framework.

``ForkServer.start`` runs ``forkserver_main.py`` as a child of the supervisor exactly as a
worker is run (own session, the death-signal wrapper; the caller registers it with the
guardian) and sends it its configuration; ``ready`` waits for its report (the preload
done, or why it cannot serve); ``fork`` asks for one standby and returns it as a
``Forked``: its pid, a pidfd on it, and the supervisor's end of its socket, over which the
standby speaks the protocol of a started standby (``R``, then the go message).

Why not ``multiprocessing.forkserver``: its children are the server's, so the supervisor
could neither ``waitid`` them through a pidfd nor keep them as zombies (the exit and pid
pinning rules of ``spawn.py``); each child runs ``multiprocessing.spawn._main`` on a
pickled ``Process`` (a callable, not a script run as ``__main__``) with the
``multiprocessing`` machinery imported; it neither calls ``setsid`` nor sets a death
signal; and it silently ignores a preload that fails. What it has that fits is used: a
Unix socket per server, ``SCM_RIGHTS`` to pass descriptors (``socket.send_fds``), the
preload done once in the server.

Blocking calls (``start``, ``fork``, ``stop``) are meant for a worker thread, never the loop.
"""

from __future__ import annotations

import contextlib
import logging
import marshal
import os
import signal
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
import msgspec

from supervisor.workers.proctree import parent_of
from supervisor.workers.spawn import DeathSignal, Worker, WorkerSpec, spawn_worker
from supervisor.workers.warm.programs import preload_source

logger = logging.getLogger(__name__)

PROGRAM = Path(__file__).with_name("forkserver_main.py")
NAMESPACE = "__elastic_forkserver__"  # ``__name__`` of the program: also how tools know it
FORK_TIMEOUT = 5.0  # seconds a fork request may take before the server is given up
MAX_REPORT = 1 << 20
MAX_BATCH = 64  # standbys in one request (forkserver_main.MAX_BATCH: its descriptors)


class ForkServerError(OSError):
    """The fork server cannot serve (dead, failed preload, refused request)."""


class ForkServerConfig(msgspec.Struct, frozen=True):
    """What a fork server imports and where: the same for every rank of the node."""

    python: str
    env: dict[str, str]  # the node's worker environment less per-attempt and per-rank names
    cwd: str | None
    path0: str | None  # the cold command's sys.path[0] (None: Python prepends nothing)
    preload: tuple[str, ...] = ()
    auto_names: tuple[str, ...] = ()  # --preload auto: names learned from the workers
    exclude: frozenset[str] = frozenset()  # packages never to preload (they read a name)
    watch: tuple[str, ...] = ()  # names whose lookup while importing taints the import


class ForkServerReport(msgspec.Struct, frozen=True):
    """The server's answer once it has preloaded (validated: it is a child's output)."""

    ok: bool
    error: str = ""
    tainted: str | None = None  # top-level package that read a watched name
    threaded: str | None = None  # module after whose import a thread was left running
    skipped: list[str] = []


@dataclass(eq=False)
class ForkedProcess:
    """A child the supervisor adopted (not spawned by it): what ``Worker`` needs of a
    ``Popen``, through ``waitpid`` (it is our child once its intermediate parent exited)."""

    pid: int
    returncode: int | None = None

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:  # unreaped: the pid is still this process's
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


@dataclass(frozen=True)
class Wanted:
    """One standby to fork: its rank's environment (the per-attempt names left out) and
    CPUs."""

    local_rank: int
    env: Mapping[str, str]
    cpus: tuple[int, ...] | None = None


@dataclass(eq=False)
class Forked:
    """A standby the server forked: ours now (its parent is the supervisor)."""

    process: Worker
    sock: socket.socket


def bootstrap_argv(prefix: Sequence[str]) -> list[str]:
    """``python -u -c CODE``: run the program in a namespace of its own, so ``__main__``
    is left as a cold interpreter leaves it for the user's code, with the child-side
    preload module's text at hand (``programs``)."""
    source = PROGRAM.read_text(encoding="utf-8")
    code = (f"exec(compile({source!r}, {str(PROGRAM)!r}, 'exec'), "
            f"{{'__name__': {NAMESPACE!r}, 'PRELOAD_SOURCE': {preload_source()!r}}})")
    return [*prefix, "-c", code]


def cold_path0(command: Sequence[str], cwd: str | None, env: Mapping[str, str]) -> str | None:
    """What Python puts first on ``sys.path`` for ``command`` (the worker's arguments after
    the interpreter and its options) run in ``cwd``: the script's real directory, the
    working directory for ``-m``, ``''`` for ``-c``; None with ``PYTHONSAFEPATH`` set."""
    if env.get("PYTHONSAFEPATH"):
        return None
    here = os.path.abspath(cwd or os.getcwd())
    if command and command[0] == "-m":
        return here
    if command and command[0] == "-c":
        return ""
    script = command[0] if command else ""
    return os.path.dirname(os.path.realpath(os.path.join(here, script)))


def _pids(data: bytes, asked: int) -> list[int | None]:
    """The pids of a fork reply, in the request's order (None: not forked);
    ForkServerError if it has none."""
    try:
        reply = marshal.loads(data) if data else {"error": "the fork server exited"}
    except (ValueError, EOFError, TypeError) as exc:
        raise ForkServerError(f"unreadable reply: {exc}") from exc
    pids = reply.get("pids") if isinstance(reply, dict) else None
    if not isinstance(pids, dict) or not pids \
            or not all(isinstance(p, int) and p > 0 for p in pids.values()):
        raise ForkServerError(str(reply.get("error") if isinstance(reply, dict) else reply))
    return [pids.get(index) for index in range(asked)]


def is_fork_server_command(argv: Sequence[str]) -> bool:
    """Whether a command line is a fork server's (or a standby it forked)."""
    return any(NAMESPACE in arg for arg in argv)


class ForkServer:
    """One running fork server."""

    def __init__(self, process: Worker, sock: socket.socket, config: ForkServerConfig) -> None:
        self.process = process
        self.sock = sock
        self.config = config
        self.report: ForkServerReport | None = None
        self.started_at = time.monotonic()

    @property
    def pid(self) -> int:
        return self.process.pid

    @classmethod
    def start(cls, config: ForkServerConfig, death: DeathSignal, prefix: Sequence[str],
              *, owner: int | None = None) -> ForkServer:
        """Start the server and send it its configuration. Raises OSError."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            spec = WorkerSpec(-1, -1, bootstrap_argv(prefix), dict(config.env), cwd=config.cwd)
            process = spawn_worker(spec, death, stdin=theirs.fileno())
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        server = cls(process, ours, config)
        message = {
            "preload": list(config.preload),
            "auto": ({"names": list(config.auto_names), "exclude": sorted(config.exclude)}
                     if config.auto_names else None),
            "watch": list(config.watch),
            "path0": config.path0,
            "owner": os.getpid() if owner is None else owner,
        }
        try:
            ours.send(marshal.dumps(message))
        except OSError:
            server.stop()
            raise
        return server

    async def ready(self) -> ForkServerReport:
        """Wait for the preload's report (the server's first message)."""
        if self.report is None:
            with contextlib.suppress(anyio.ClosedResourceError, OSError):
                await anyio.wait_readable(self.sock)
            self.report = self._read_report()
        return self.report

    def wait_ready(self, timeout: float | None = None) -> ForkServerReport:
        """``ready`` for a worker thread or a test: blocking, at most ``timeout`` s."""
        if self.report is None:
            self.sock.settimeout(timeout)
            try:
                self.report = self._read_report()
            finally:
                self.sock.settimeout(None)
        return self.report

    def _read_report(self) -> ForkServerReport:
        try:
            data = self.sock.recv(MAX_REPORT)
        except TimeoutError:
            return ForkServerReport(False, "the fork server did not report in time")
        except OSError as exc:
            return ForkServerReport(False, f"the fork server's socket: {exc}")
        if not data:
            status = self.process.poll_exit()
            return ForkServerReport(False, f"the fork server exited ({status})")
        try:
            return msgspec.convert(marshal.loads(data), ForkServerReport)
        except (ValueError, EOFError, TypeError, msgspec.ValidationError) as exc:
            return ForkServerReport(False, f"the fork server's report is unreadable: {exc}")

    @property
    def usable(self) -> bool:
        """Ready, preloaded, and still running."""
        return (self.report is not None and self.report.ok and self.sock.fileno() >= 0
                and self.process.poll_exit() is None)

    def fork(self, wanted: Sequence[Wanted], timeout: float = FORK_TIMEOUT
             ) -> list[Forked | None]:
        """Fork a standby for each of ``wanted`` in one request (what differs per rank
        applied in each child): in ``wanted``'s order, None for one the server could not
        fork. Raises ForkServerError if the server cannot (it is then of no further use)."""
        if not self.usable:
            raise ForkServerError("the fork server is not ready")
        forked: list[Forked | None] = []
        for start in range(0, len(wanted), MAX_BATCH):
            forked += self._fork_batch(wanted[start:start + MAX_BATCH], timeout)
        return forked

    def _fork_batch(self, wanted: Sequence[Wanted], timeout: float) -> list[Forked | None]:
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in wanted]
        try:
            request = marshal.dumps({"standbys": [
                {"env": dict(w.env), "cpus": list(w.cpus) if w.cpus else None}
                for w in wanted]})
            self.sock.settimeout(timeout)
            socket.send_fds(self.sock, [request], [theirs.fileno() for _, theirs in pairs])
            data = self.sock.recv(MAX_REPORT)
        except OSError as exc:
            for ours, _ in pairs:
                ours.close()
            raise ForkServerError(f"the fork server did not answer: {exc}") from exc
        finally:
            for _, theirs in pairs:
                theirs.close()
            with contextlib.suppress(OSError):
                self.sock.settimeout(None)
        try:
            pids = _pids(data, len(wanted))
        except ForkServerError as exc:
            for ours, _ in pairs:
                ours.close()
            raise ForkServerError(f"fork refused: {exc}") from exc
        forked: list[Forked | None] = []
        for want, (ours, _), pid in zip(wanted, pairs, pids, strict=True):
            try:
                if pid is None:
                    raise ForkServerError("the intermediate child could not fork it")
                forked.append(Forked(self._adopt(pid, want), ours))
            except ForkServerError as exc:
                logger.warning("standby for local rank %d not forked: %s", want.local_rank,
                               exc)
                ours.close()
                forked.append(None)
        return forked

    @staticmethod
    def _adopt(pid: int, want: Wanted) -> Worker:
        """Pin the reported pid and check it is our child (so the pid cannot be recycled
        before we reap it)."""
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:
            raise ForkServerError(f"standby {pid} is gone: {exc}") from exc
        if parent_of(pid) != os.getpid():
            os.close(pidfd)
            raise ForkServerError(f"standby {pid} is not our child (are we a subreaper?)")
        spec = WorkerSpec(want.local_rank, -1, [], dict(want.env), cpus=want.cpus)
        return Worker(spec, ForkedProcess(pid), pidfd, time.monotonic(), time.time())

    def stop(self) -> None:
        """Close its socket (it exits), kill its process group, reap it. The standbys it
        forked are in sessions of their own and are not touched."""
        with contextlib.suppress(OSError):
            self.sock.close()
        process = self.process
        with process.lock:  # from the check to the reap: no other stop reaps it meanwhile
            if not process.reaped:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.reap()
