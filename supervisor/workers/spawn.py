"""Spawning workers and noticing their exits the instant they happen.

Each worker runs in its own session (so its process group id is its pid) under an exec
wrapper that sets the kernel's parent-death signal: no ``preexec_fn``, which is unsafe in a
process that holds gRPC or other fork-unsafe state. Exits are observed through a pidfd with
``waitid(..., WNOWAIT)``: the worker stays a zombie until the group is stopped, so neither
its pid nor its process group id can be recycled while we may still signal them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import anyio
import anyio.to_thread
import msgspec

logger = logging.getLogger(__name__)


class WorkerSpec(msgspec.Struct, frozen=True):
    """Everything needed to start one worker."""

    local_rank: int
    global_rank: int
    argv: Sequence[str]
    env: dict[str, str]
    stdout: int | None = None  # file descriptor to use as stdout; None inherits ours
    stderr: int | None = None
    cwd: str | None = None
    cpus: tuple[int, ...] | None = None  # CPU affinity (NUMA binding)


class ExitStatus(msgspec.Struct, frozen=True):
    exit_code: int | None  # None when killed by a signal
    signal: int | None
    at: float  # monotonic time the exit was observed

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class ChildProcess(Protocol):
    """What a worker needs of its process: a ``Popen``, or a child the supervisor adopted
    (a standby forked by the fork server, ``warm.forkserver.ForkedProcess``)."""

    @property
    def pid(self) -> int: ...

    def wait(self) -> int: ...

    def kill(self) -> None: ...


@dataclass(frozen=True)
class Start:
    """How a worker started: in its rank's standby (warm) or cold, and for a cold one
    whose rank had a standby, why that could not take it (a metric label)."""

    warm: bool = False
    cold_reason: str | None = None


@dataclass(eq=False)
class Worker:
    """A started worker. Only the monitor and the stopper touch it."""

    spec: WorkerSpec
    popen: ChildProcess
    pidfd: int
    started_at: float  # monotonic
    started_at_wall: float
    status: ExitStatus | None = None
    reaped: bool = False
    exited: anyio.Event = field(default_factory=anyio.Event)  # set by the worker's monitor
    start: Start = Start()
    # held from "not reaped yet" to "reaped": a fork server can be found dead by a fork on
    # the spawner thread and by the event loop at once, and both stop it
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def local_rank(self) -> int:
        return self.spec.local_rank

    def poll_exit(self) -> ExitStatus | None:
        """The exit status if the worker has exited, without reaping it."""
        if self.status is not None:
            return self.status
        if self.reaped:
            return self.status
        try:
            info = os.waitid(os.P_PIDFD, self.pidfd, os.WEXITED | os.WNOWAIT | os.WNOHANG)
        except ChildProcessError:
            return None
        if info is None or info.si_pid == 0:
            return None
        now = time.monotonic()
        if info.si_code == os.CLD_EXITED:
            self.status = ExitStatus(info.si_status, None, now)
        else:  # CLD_KILLED or CLD_DUMPED
            self.status = ExitStatus(None, info.si_status, now)
        return self.status

    def signal_group(self, signum: int) -> bool:
        """Signal the worker's whole process group. Safe while we hold it unreaped."""
        if self.reaped:
            return False
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            return False
        except PermissionError:
            logger.warning("not permitted to signal process group %d", self.pid)
            return False
        return True

    def reap(self) -> None:
        """Collect the zombie; after this the pid may be reused, so never signal it again."""
        with self.lock:
            if self.reaped:
                return
            notify_reaping(self.pid)
            self.popen.wait()
            self.reaped = True
            os.close(self.pidfd)


_reaping_hooks: list[Callable[[int], None]] = []


def on_reaping(hook: Callable[[int], None]) -> Callable[[], None]:
    """Have ``hook(pid)`` called just before any child of ours is reaped; returns the
    function that removes it.

    Reaping is a process-wide event: from then on the pid (and a worker's process group
    id) may be recycled, so whatever names processes by number (the guardian) must hear of
    it first, wherever the reaping happens (a stop, a later sweep, a standby's discard)."""
    _reaping_hooks.append(hook)

    def remove() -> None:
        with contextlib.suppress(ValueError):
            _reaping_hooks.remove(hook)

    return remove


def notify_reaping(pid: int) -> None:
    """Tell the ``on_reaping`` hooks that ``pid`` (dead, not yet reaped) is about to be."""
    for hook in list(_reaping_hooks):
        hook(pid)


class DeathSignal:
    """Builds the exec-wrapper prefix that makes the kernel kill a worker when we die.

    ``setpriv --pdeathsig`` (util-linux 2.33 and later) where it works, else a small Python
    shim: older setprivs (Ubuntu 18.04's 2.31, RHEL 8's 2.32) reject the option, and every
    worker would fail to start. Whether it works is probed once per process."""

    def __init__(self) -> None:
        self.setpriv = usable_setpriv()
        self.taskset = shutil.which("taskset")

    @property
    def kind(self) -> str:
        """``setpriv`` or ``shim``: what is in use (for the start-up log and tests)."""
        return "setpriv" if self.setpriv else "shim"

    def prefix(self, cpus: tuple[int, ...] | None = None) -> list[str]:
        head: list[str]
        if self.setpriv:
            head = [self.setpriv, "--pdeathsig", "KILL", "--"]
        else:
            head = [sys.executable, "-S", "-c", _PDEATHSIG_SHIM, str(os.getpid())]
        if cpus and self.taskset:
            head += [self.taskset, "--cpu-list", ",".join(map(str, cpus))]
        return head


PROBE_TIMEOUT = 5.0  # seconds; a setpriv that does not run /bin/true by then is not used


@functools.cache
def usable_setpriv() -> str | None:
    """The path of a ``setpriv`` that accepts ``--pdeathsig``, or None; logs the choice.

    Run once per process (one ~1 ms spawn): ``setpriv --pdeathsig KILL -- true``."""
    setpriv = shutil.which("setpriv")
    reason = "no setpriv on PATH"
    if setpriv is not None:
        true = shutil.which("true")
        probe = [true] if true else [sys.executable, "-S", "-c", ""]
        try:
            result = subprocess.run(
                [setpriv, "--pdeathsig", "KILL", "--", *probe], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=PROBE_TIMEOUT,
                close_fds=True,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            reason = f"{setpriv} cannot run: {exc}"
        else:
            if result.returncode == 0:
                logger.info("worker death signal: %s --pdeathsig KILL", setpriv)
                return setpriv
            said = result.stderr.decode(errors="replace").strip().splitlines()
            reason = (f"{setpriv} rejects --pdeathsig (util-linux < 2.33?): "
                      f"{said[0] if said else 'exit ' + str(result.returncode)}")
    logger.info("worker death signal: Python shim (%s)", reason)
    return None


# Fallback where util-linux's setpriv is missing: set PR_SET_PDEATHSIG (1) to SIGKILL, check
# the parent did not already die, then exec the real command.
_PDEATHSIG_SHIM = (
    "import ctypes,os,sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)\n"
    "os.getppid() == int(sys.argv[1]) or os._exit(137)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


T = TypeVar("T")
_Job = tuple[Callable[[], object], "concurrent.futures.Future[object]"]


class Spawner:
    """One long-lived thread from which every child of the supervisor is spawned.

    The kernel sends a child its parent-death signal (``PR_SET_PDEATHSIG``, which every
    child of ours asks for) when the *thread* that forked it exits, not the process: a
    standby spawned from an anyio worker thread was SIGKILLed once anyio retired that idle
    thread. So children are forked only here, from a thread that lives as long as the
    supervisor (started with it, stopped at its very end, after every child is reaped).
    ``spawn`` lets the event loop go on while the spawner forks (standbys, the hosted
    etcd); ``call`` blocks its caller until the child exists (the launch of a group, which
    needs its workers at once).
    """

    def __init__(self, name: str = "spawner") -> None:
        self.name = name
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def native_id(self) -> int | None:
        """The spawner thread's kernel id (None: not running), for tests and diagnostics."""
        thread = self._thread
        return thread.native_id if thread is not None else None

    def start(self) -> None:
        """Start the thread (idempotent)."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                # daemon: a supervisor that ends abnormally must not hang on it; its children
                # die with the process then, as their death signal intends
                self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Finish the queued spawns and end the thread. Only once no child of ours lives:
        their death signal fires when it ends."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            self._queue.put(None)
            thread.join(timeout)

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            fn, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller, who re-raises it
                future.set_exception(exc)

    def _submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        self.start()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._queue.put((fn, future))  # type: ignore[arg-type]
        return future

    def call(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """Run ``fn(*args, **kwargs)`` on the spawner thread; its result (blocking)."""
        if self._thread is threading.current_thread():
            return fn(*args, **kwargs)
        return self._submit(functools.partial(fn, *args, **kwargs)).result()

    async def spawn(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """``call`` for async code: the loop goes on while the spawner forks."""
        future = self._submit(functools.partial(fn, *args, **kwargs))
        return await anyio.to_thread.run_sync(future.result)


SPAWNER = Spawner()  # the supervisor's; app.py starts it first and stops it last


def spawn_worker(
    spec: WorkerSpec, death: DeathSignal, *, stdin: int | None = None, start: Start = Start()
) -> Worker:
    """Start one worker in its own session. Raises OSError if it cannot be started.

    ``stdin``: a descriptor for the worker's stdin (a standby's control socket); by
    default ``/dev/null``, as torchrun gives its workers. ``start``: how it started (a
    cold start, and why if its rank's standby could not take it)."""
    argv = [*death.prefix(spec.cpus), *spec.argv]
    popen = subprocess.Popen(
        argv,
        env=spec.env,
        stdin=subprocess.DEVNULL if stdin is None else stdin,
        stdout=spec.stdout,
        stderr=spec.stderr,
        cwd=spec.cwd,
        start_new_session=True,  # own session and process group: pgid == pid
        close_fds=True,
    )
    try:
        pidfd = os.pidfd_open(popen.pid)
    except OSError:
        popen.kill()
        popen.wait()
        raise
    if spec.cpus and not death.taskset:
        _set_affinity(popen.pid, spec.cpus)
    return Worker(spec, popen, pidfd, time.monotonic(), time.time(), start=start)


def _set_affinity(pid: int, cpus: tuple[int, ...]) -> None:
    try:
        os.sched_setaffinity(pid, cpus)
    except OSError as exc:
        logger.warning("could not bind pid %d to CPUs %s: %s", pid, cpus, exc)


async def wait_exit(worker: Worker) -> ExitStatus:
    """Wait until the worker exits (pidfd readable); do not reap it."""
    while True:
        status = worker.poll_exit()
        if status is not None:
            return status
        await anyio.wait_readable(worker.pidfd)


def signal_workers(workers: Sequence[Worker], signum: int) -> None:
    """Forward a signal (e.g. SIGUSR1 preemption notice) to each live worker's group."""
    for worker in workers:
        if worker.poll_exit() is None:
            worker.signal_group(signum)
