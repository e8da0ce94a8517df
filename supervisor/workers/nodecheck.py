"""Run the node check: the built-in checks, then ``--node-check CMD`` (no shell).

The command is started as a worker is (``spawn.spawn_worker``): from the spawner thread,
under the death-signal wrapper (it dies with us), in a session and process group of its
own, registered with the guardian and carrying the workers' cookie in its environment
(so whatever it leaves behind is found and killed if we are SIGKILLed). Its exit is seen
through a pidfd without reaping it: the leader stays a zombie until its group has been
killed, so neither its pid nor its group id can be recycled while we may signal them.

When it exits, on its timeout, or when the caller stops (cancellation), its group is
SIGKILLed (the leader through its pidfd, the group by number while the unreaped leader
holds it, the processes it started in other sessions through pidfds: its descendants
while it lives, and those reparented to us that carry its mark, ``CHECK_MARK_ENV``),
then the leader is reaped, waiting at most ``KILL_WAIT`` seconds: a check stuck in
uninterruptible sleep (``nvidia-smi`` on a GPU that fell off the bus) fails and is
abandoned (reaped by a later check once it is dead), never waited for. A group's stop
leaves a running check alone (``running_pids``).

Its combined stdout and stderr are read until the leader exits (then what is left in the
pipe: a helper that keeps the pipe open is not waited for), and only the first
``OUTPUT_LIMIT`` bytes are kept; the reason of a failure is their first non-empty line.
Exit 0 is healthy; anything else, or a timeout, is not.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.lowlevel
import anyio.to_thread

from supervisor.core.nodehealth import CheckResult, check_failure_reason, disk_verdict
from supervisor.workers.guardian import Guardian
from supervisor.workers.proctree import children
from supervisor.workers.spawn import (
    SPAWNER,
    DeathSignal,
    Spawner,
    Worker,
    WorkerSpec,
    spawn_worker,
    wait_exit,
)
from supervisor.workers.stop import ProcessTree

logger = logging.getLogger(__name__)

OUTPUT_LIMIT = 64 * 1024
NOT_RUNNABLE = (126, 127)  # the shell's "not executable" and "not found"
KILL_WAIT = 5.0  # seconds a SIGKILLed check may take to die before it is abandoned
READS_PER_TURN = 16  # pipe reads before the loop runs again (a flooding check)
CHECK_MARK_ENV = "ELASTIC_SUPERVISOR_NODE_CHECK"
"""In a check's environment: finds what it left behind in another session once it exited."""

_running: set[int] = set()  # leaders of the checks in progress
_abandoned: dict[int, Worker] = {}  # leaders that outlived SIGKILL by KILL_WAIT, unreaped


def running_pids() -> set[int]:
    """Our children that are node checks (running, or abandoned and not reaped yet): a
    worker group's sweep of adopted children must leave them alone."""
    return _running | set(_abandoned)


@dataclass(frozen=True)
class CheckLauncher:
    """What starts a check as workers are started: their death-signal wrapper, the
    guardian, the spawner thread."""

    death: DeathSignal = field(default_factory=DeathSignal)
    guardian: Guardian | None = None
    spawner: Spawner = SPAWNER


@dataclass(frozen=True)
class CommandRun:
    """How the command ended: exit code (negative: the signal; None: timed out), whether
    it timed out, the first bytes of its output, whether it outlived SIGKILL."""

    code: int | None
    timed_out: bool
    output: bytes
    abandoned: bool = False


class NodeCheckConfigError(Exception):
    """The check command cannot run at all (not found, not executable): a setting error."""


class NodeChecker:
    """One node's checks: built in (the log directory) and the configured command."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], timeout: float,
                 log_dir: Path, launcher: CheckLauncher | None = None) -> None:
        self.argv = list(argv)
        self.env = {**env, CHECK_MARK_ENV: uuid.uuid4().hex}
        self.timeout = timeout
        self.log_dir = log_dir
        self.launcher = launcher if launcher is not None else CheckLauncher()
        self.runs = 0
        self.failures = 0

    async def run(self) -> CheckResult:
        """Run every check once; raises ``NodeCheckConfigError`` if the command cannot
        run on its first run (exit 126/127 or no such program); later, that is unhealthy."""
        started = time.monotonic()
        self.runs += 1
        reason = await anyio.to_thread.run_sync(check_log_dir, self.log_dir)
        code: int | None = None
        timed_out = False
        if not reason and self.argv:
            ran = await run_command(self.argv, self.env, self.timeout, self.launcher)
            code, timed_out = ran.code, ran.timed_out
            if code in NOT_RUNNABLE and self.runs == 1:  # at start: a setting, not the node
                raise NodeCheckConfigError(
                    f"node_check: {self.argv[0]!r} exited with {code} "
                    f"({'not executable' if code == 126 else 'not found'}): "
                    f"{check_failure_reason(code, False, self.timeout, ran.output)}")
            if code != 0 or ran.abandoned:
                reason = check_failure_reason(code, timed_out, self.timeout, ran.output)
            if ran.abandoned:
                reason += (f" (and it did not die within {KILL_WAIT:g} s of SIGKILL: "
                           "uninterruptible sleep? abandoned)")
        now = time.monotonic()
        if reason:
            self.failures += 1
        return CheckResult(not reason, reason, now, now - started, code, timed_out)


def check_log_dir(path: Path) -> str:
    """The built-in check (in a thread: file system calls may block): the log directory
    takes a file and has ``MIN_FREE_BYTES`` free. "" when healthy."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix=".node-check-"):
            writable = True
    except OSError:
        writable = False
    try:
        stats = os.statvfs(path)
        free = stats.f_bavail * stats.f_frsize
    except OSError:
        free = 0
    return disk_verdict(free, writable, str(path))


async def run_command(argv: Sequence[str], env: Mapping[str, str], timeout: float,
                      launcher: CheckLauncher, limit: int = OUTPUT_LIMIT) -> CommandRun:
    """Run the command for at most ``timeout`` seconds, then kill its process group (see
    the module's docstring). A program that cannot be started is exit 127 (not found) or
    126 (not executable), as from a shell."""
    _reap_abandoned()
    started = _unrunnable(argv[0], env) or await _start(argv, env, launcher)
    if isinstance(started, CommandRun):
        return started
    check, read_end = started
    kept = bytearray()
    reaped = False
    try:
        with anyio.move_on_after(timeout) as scope:
            await _read_until_exit(check, read_end, kept, limit)
    finally:
        with anyio.CancelScope(shield=True):
            reaped = await _kill_group(check, env.get(CHECK_MARK_ENV))
        os.close(read_end)
        _running.discard(check.pid)
    if scope.cancelled_caught or check.status is None:
        return CommandRun(None, True, bytes(kept), not reaped)
    status = check.status
    code = status.exit_code if status.exit_code is not None else -(status.signal or 0)
    return CommandRun(code, False, bytes(kept), not reaped)


async def _start(argv: Sequence[str], env: Mapping[str, str], launcher: CheckLauncher
                 ) -> tuple[Worker, int] | CommandRun:
    """The check, started as a worker is, and the read end of its output pipe (non-blocking);
    or exit 126 with the reason if it could not be started."""
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    try:
        spec = WorkerSpec(-1, -1, list(argv), dict(env), stdout=write_end, stderr=write_end)
        check = await launcher.spawner.spawn(spawn_worker, spec, launcher.death)
    except OSError as exc:
        os.close(read_end)
        return CommandRun(126, False, str(exc).encode())
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)  # the check holds it: EOF once it (and its helpers) closed it
    _running.add(check.pid)
    if launcher.guardian is not None:
        launcher.guardian.watch(check.pid)
    os.set_blocking(read_end, False)
    return check, read_end


def _unrunnable(program: str, env: Mapping[str, str]) -> CommandRun | None:
    """127 or 126 with the reason, as a shell would say, before anything is started (the
    death-signal wrapper would say it less clearly)."""
    if shutil.which(program, path=env.get("PATH", os.defpath)) is not None:
        return None
    if "/" in program and os.path.exists(program):
        return CommandRun(126, False, f"[Errno {errno.EACCES}] Permission denied: "
                                      f"{program!r}".encode())
    return CommandRun(127, False, f"[Errno {errno.ENOENT}] No such file or directory: "
                                  f"{program!r}".encode())


async def _read_until_exit(check: Worker, fd: int, kept: bytearray, limit: int) -> None:
    """Keep the output until the leader exits, then what is left in the pipe (a helper
    that holds it open is not waited for)."""
    async with anyio.create_task_group() as tg:

        async def read() -> None:
            while _read_some(fd, kept, limit):
                await anyio.wait_readable(fd)

        tg.start_soon(read)
        await wait_exit(check)
        tg.cancel_scope.cancel()
    _read_some(fd, kept, limit)


def _read_some(fd: int, kept: bytearray, limit: int) -> bool:
    """Read what the pipe holds (at most ``READS_PER_TURN`` reads); False at EOF."""
    for _ in range(READS_PER_TURN):
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        if len(kept) < limit:
            kept += chunk[: limit - len(kept)]
    return True


async def _kill_group(check: Worker, mark: str | None) -> bool:
    """SIGKILL the check, its group and what it started elsewhere; reap it within
    ``KILL_WAIT`` seconds. False: it did not die (abandoned, reaped by a later check)."""
    tree = ProcessTree()  # pinned by pidfds: a recycled pid is never hit
    tree.add_descendants([check.pid])  # while the leader lives
    if mark:  # its orphans, reparented to us (a child subreaper) once it exited
        me = os.getpid()
        left = [p for p in children(me) if p != check.pid and _carries(p, mark)]
        for pid in left:
            tree.add(pid, me)
        tree.add_descendants(left)
    with contextlib.suppress(ProcessLookupError):
        signal.pidfd_send_signal(check.pidfd, signal.SIGKILL)
    check.signal_group(signal.SIGKILL)  # by number: safe, the unreaped leader holds it
    tree.signal(signal.SIGKILL)
    tree.close()
    with anyio.move_on_after(KILL_WAIT):
        await wait_exit(check)
    if check.poll_exit() is None:
        logger.error("node check pid %d did not die within %g s of SIGKILL (uninterruptible "
                     "sleep?); abandoned, it is reaped once it dies", check.pid, KILL_WAIT)
        _abandoned[check.pid] = check
        return False
    check.reap()  # the guardian forgets it first (spawn.on_reaping)
    return True


def _carries(pid: int, mark: str) -> bool:
    """Whether ``pid``'s environment holds ``CHECK_MARK_ENV=mark``."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{CHECK_MARK_ENV}={mark}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def _reap_abandoned() -> None:
    for pid, check in list(_abandoned.items()):
        if check.poll_exit() is not None:
            check.reap()
            del _abandoned[pid]
            logger.info("node check pid %d that outlived SIGKILL is reaped", pid)
