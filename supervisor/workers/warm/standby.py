"""A standby: a pre-started interpreter per local rank that its rank's next worker runs in.

It starts like a worker (own session, the parent-death wrapper, NUMA binding) with the
environment its rank's next worker will get less ``PER_ATTEMPT_ENV``, optionally imports
``--preload`` modules at idle CPU priority, reports once (``reports``), and waits on a Unix
socket; ``go`` hands it the worker's per-attempt variables, command line and output fds.
The program itself is ``standby_main``; the hand-off, what it preserves of a cold start
and what differs are in docs/design.md ("Warm restarts") and docs/torchrun-compat.md.
"""

from __future__ import annotations

import array
import contextlib
import functools
import logging
import marshal
import os
import signal
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import anyio
import msgspec

from supervisor.core.envs import PER_ATTEMPT_ENV, interpreter
from supervisor.workers.spawn import DeathSignal, Start, Worker, WorkerSpec, spawn_worker
from supervisor.workers.warm import autopreload, reports
from supervisor.workers.warm.programs import preload_source

logger = logging.getLogger(__name__)

GO_TIMEOUT = 2.0  # seconds the go message may take to be accepted before a cold spawn
# seconds a forked standby still setting itself up (milliseconds, one after another in
# its batch) may take to report before its worker starts cold instead: a set-up that
# fails after the go message would look like the worker's failure
SETUP_WAIT = 0.5
HEADER = 8  # bytes: big-endian length of the marshalled go message

__all__ = ["PER_ATTEMPT_ENV", "SETUP_WAIT", "Standby", "StandbyOptions", "discard_all",
           "env_mismatch", "is_standby_command", "spawn_standby", "standby_code",
           "standby_env"]


@functools.cache
def standby_code() -> str:
    """The standby program's text and the call that runs it with the child-side preload
    module's text (``programs``), run as ``python -u -c TEXT`` (see standby_main)."""
    program = (Path(__file__).parent / "standby_main.py").read_text(encoding="utf-8")
    source, filename = preload_source()
    return f"{program}\n_standby({source!r}, {filename!r})\n"


class StandbyOptions(msgspec.Struct, frozen=True):
    """How standbys are prepared: modules to import before waiting (``--preload``)."""

    preload: tuple[str, ...] = ()
    auto: bool = False  # also what the rank's last worker imported (``--preload auto``)


def standby_env(worker_env: Mapping[str, str]) -> dict[str, str]:
    """A rank's worker environment less the variables that change per attempt."""
    return {k: v for k, v in worker_env.items() if k not in PER_ATTEMPT_ENV}


def env_mismatch(started: Mapping[str, str], worker_env: Mapping[str, str]) -> str | None:
    """The first variable (other than the per-attempt ones) a standby started with
    ``started`` would get wrong for ``worker_env``; None if there is none."""
    wanted = standby_env(worker_env)
    for name in sorted(started.keys() | wanted.keys()):
        if started.get(name) != wanted.get(name):
            return name
    return None


class Standby:
    """One pre-started interpreter waiting for its worker's command line."""

    def __init__(
        self,
        process: Worker,
        sock: socket.socket,
        prefix: Sequence[str],
        env: Mapping[str, str],
        preload: Sequence[str] = (),
        auto_spec: str | None = None,
        *,
        forked: bool = False,
    ) -> None:
        self.process = process  # a Worker whose spec is the standby's own command
        self.sock = sock
        self.prefix = list(prefix)  # interpreter and options: [python, "-u"]
        self.env = dict(env)  # what it was started with
        self.preload = tuple(preload)
        self.auto_spec = auto_spec  # the file with its auto list (it removes it)
        self.idle = False  # waiting at SCHED_IDLE (set back to normal at the hand-off)
        self.forked = forked  # by the fork server: it reports once its set-up is done
        self._report: reports.Report | None = None  # once the standby reported

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def local_rank(self) -> int:
        return self.process.local_rank

    @staticmethod
    def accepts(prefix: Sequence[str], argv: Sequence[str]) -> bool:
        """Whether a standby started with ``prefix`` runs ``argv`` as a cold start would."""
        n = len(prefix)
        if list(argv[:n]) != list(prefix) or len(argv) <= n:
            return False
        head = argv[n]
        if head in ("-m", "-c"):
            return len(argv) > n + 1
        # a source file: a directory or zip (run as a package) or a .pyc go cold
        return not head.startswith("-") and head.endswith(".py") and os.path.isfile(head)

    @property
    def preloading(self) -> bool:
        return bool(self.preload) or self.auto_spec is not None

    def report(self) -> reports.Report | None:
        """Its report, once it came (without preloading: always ready); None while it
        still imports."""
        if not self.preloading and not self.forked:
            return reports.Ready()
        if self._report is None:
            try:
                data = self.sock.recv(4096, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return None  # still importing
            except OSError as exc:
                data = reports.FAILED + str(exc).encode()
            self._report = reports.parse(data)
        return self._report

    def preloaded(self) -> bool | None:
        """True once the preload finished, False if it failed, None while it runs."""
        report = self.report()
        return None if report is None else isinstance(report, reports.Ready)

    def preload_failure(self) -> str | None:
        """The preload's error, if it reported one (the standby is then of no use)."""
        report = self.report()
        return report.message if isinstance(report, reports.Failed) else None

    @property
    def skipped(self) -> str:
        """Modules an auto preload could not import (a ready standby's report says)."""
        return self._report.skipped if isinstance(self._report, reports.Ready) else ""

    def tainted(self) -> str | None:
        """The top-level package an auto preload found reading a per-attempt variable."""
        report = self.report()
        return report.tainted if isinstance(report, reports.Failed) else None

    def go(
        self,
        spec: WorkerSpec,
        per_attempt: Mapping[str, str],
        await_store: tuple[str, int, float] | None = None,
        record: str | None = None,
    ) -> Worker | None:
        """Hand the worker over; None if the standby cannot take it (it is then gone).

        ``per_attempt``: the variables applied on top of the standby's environment; the
        caller has checked that the rest of ``spec.env`` equals what it started with.
        ``await_store``: (host, port, seconds): before the user's code runs, wait (at
        most that long) until rank 0's store of this attempt accepts connections.
        ``record``: where the worker records the modules it imports (``--preload auto``)."""
        if self.process.poll_exit() is not None:
            logger.warning("standby for local rank %d exited before it was used (%s)",
                           self.local_rank, self.process.status)
            self.discard()
            return None
        if self.forked and not self._set_up():
            self.discard()
            return None
        if self.idle and not _set_policy(self.pid, os.SCHED_OTHER, every_thread=True):
            logger.warning("standby for local rank %d: cannot restore its CPU priority",
                           self.local_rank)
            self.discard()
            return None
        targets = [n for n, fd in ((1, spec.stdout), (2, spec.stderr)) if fd is not None]
        fds = [fd for fd in (spec.stdout, spec.stderr) if fd is not None]
        body = marshal.dumps({
            "argv": list(spec.argv[len(self.prefix):]),
            "orig_argv": list(spec.argv),
            "env": dict(per_attempt),
            # used only if a preload still running then fails: the worker execs cold
            "cold_env": dict(spec.env) if self.preloaded() is None else {},
            "fds": targets,
            "await_store": list(await_store) if await_store else None,
            "record": record,
        })
        message = len(body).to_bytes(HEADER, "big") + body
        try:
            self.sock.settimeout(GO_TIMEOUT)
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            sent = self.sock.sendmsg([message], ancillary if fds else [])
            if sent < len(message):
                self.sock.sendall(message[sent:])
        except OSError as exc:  # includes the timeout
            logger.warning("standby for local rank %d did not take its worker: %s",
                           self.local_rank, exc)
            self.discard()
            return None
        self._close()
        old = self.process
        return Worker(spec, old.popen, old.pidfd, time.monotonic(), time.time(),
                      start=Start(warm=True))

    def _set_up(self) -> bool:
        """Whether a forked standby has finished its set-up (the pool's ``ready`` gave it
        up to SETUP_WAIT s to say so)."""
        report = self.report()
        if not isinstance(report, reports.Ready):
            logger.warning("standby for local rank %d starts no worker: %s",
                           self.local_rank, "its set-up has not finished" if report is None
                           else report.message)
            return False
        return True

    def _close(self) -> None:
        if self.sock.fileno() >= 0:
            with contextlib.suppress(RuntimeError):  # outside an event loop: nobody waits
                anyio.notify_closing(self.sock)  # wakes a task waiting for the preload report
        self.sock.close()

    def discard(self) -> None:
        """Kill and reap the standby (it never ran user code: nothing to wait for)."""
        self._close()
        autopreload.remove_spec(self.auto_spec)  # if it died before reading it
        process = self.process
        if not process.reaped:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.reap()


def spawn_standby(
    local_rank: int,
    python: str,
    env: dict[str, str],
    death: DeathSignal,
    *,
    cwd: str | None = None,
    cpus: tuple[int, ...] | None = None,
    options: StandbyOptions | None = None,
    auto_spec: str | None = None,
    path0: str | None = None,
) -> Standby:
    """Start the standby of one local rank with ``env`` (see ``standby_env``).

    ``path0``: the ``sys.path[0]`` of the worker's cold command (``forkserver.cold_path0``),
    put in place before anything of the user's is imported. Raises OSError if it cannot
    be started."""
    options = options or StandbyOptions()
    prefix = interpreter(python)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    argv = [*prefix, "-c", standby_code(), path0 or ""]
    if options.preload or auto_spec:
        argv.append(",".join(options.preload))
    if auto_spec:
        argv.append(auto_spec)
    try:
        spec = WorkerSpec(local_rank, -1, argv, env, cwd=cwd, cpus=cpus)
        process = spawn_worker(spec, death, stdin=theirs.fileno())
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    standby = Standby(process, ours, prefix, env, options.preload, auto_spec)
    # Where we may raise it back at the hand-off (CAP_SYS_NICE), the standby waits at idle
    # CPU priority: its start-up never takes a CPU from the workers or from our loop.
    standby.idle = _can_raise_priority() and _set_policy(process.pid, os.SCHED_IDLE)
    return standby


def _set_policy(pid: int, policy: int, *, every_thread: bool = False) -> bool:
    """Set ``pid``'s scheduling policy (one thread's: the main one); True if it was set.

    ``every_thread``: its other threads too, as far as they let us (at the hand-off, an
    import thread still running finishes at the worker's priority, not at idle)."""
    try:
        os.sched_setscheduler(pid, policy, os.sched_param(0))
    except OSError:
        return False
    if every_thread:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                if int(tid) != pid:
                    with contextlib.suppress(OSError):  # it ended meanwhile
                        os.sched_setscheduler(int(tid), policy, os.sched_param(0))
    return True


@functools.cache
def _can_raise_priority() -> bool:
    """Whether we hold CAP_SYS_NICE (root usually), without which SCHED_IDLE is one-way."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> 23 & 1)
    except (OSError, ValueError):
        pass
    return False


def is_standby_command(argv: Sequence[str]) -> bool:
    """Whether a process's command line is a standby's (for tools that list our children)."""
    return standby_code() in argv


def discard_all(standbys: dict[int, Standby]) -> list[int]:
    """Kill and reap every standby; returns their pids (to forget in the guardian)."""
    pids = []
    for standby in standbys.values():
        pids.append(standby.pid)
        standby.discard()
    standbys.clear()
    return pids

