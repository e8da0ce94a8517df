"""Escalation against a hung worker: hang dump, requested signal, then SIGKILL.

Each step works on a ``ProcessHandle`` (a pidfd), so a signal reaches the process the
deadline named and never a later one that reuses its pid, and each step is bounded in
time. Separate from the tailer so it can be tested against a real child process.
"""

from __future__ import annotations

import enum
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType

import anyio
import anyio.abc
import anyio.to_thread
import msgspec

from supervisor.safepaths import CREATE_NEW, open_in_dir

logger = logging.getLogger(__name__)


class HangDump(msgspec.Struct, frozen=True):
    """What to capture from a hung worker before it is signalled (``--hang-dump``)."""

    mode: str = "none"  # "none", "py-spy" or "signal"
    signum: int = signal.SIGUSR1  # for mode "signal" (e.g. a faulthandler trigger)
    timeout: float = 10.0  # py-spy: longest run
    signal_wait: float = 1.0  # signal: how long the worker gets to write its dump
    py_spy: str = "py-spy"  # the py-spy executable

    @classmethod
    def parse(cls, text: str, timeout: float = 10.0) -> HangDump:
        """Parse ``none``, ``py-spy`` or ``signal:NAME|NUMBER`` (``signal:SIGUSR1``)."""
        if text in ("none", "py-spy"):
            return cls(text, timeout=timeout)
        kind, _, name = text.partition(":")
        if kind == "signal" and name:
            return cls("signal", _parse_signal(name), timeout)
        raise ValueError(f"--hang-dump must be none, py-spy or signal:NAME, not {text!r}")


def resolve_hang_dump(
    text: str, environ: Mapping[str, str], interpreter: str = sys.executable
) -> HangDump:
    """Parse ``--hang-dump`` and, for py-spy, find a py-spy that can work, at start-up.

    py-spy is looked up on ``PATH``, then next to the interpreter (a venv's ``bin``: the
    systemd unit starts the supervisor by the venv's path without activating it). Raises
    ``ValueError`` with a one-line reason when it is missing or could not attach."""
    spec = HangDump.parse(text)
    if spec.mode != "py-spy":
        return spec
    path = find_py_spy(environ.get("PATH", os.defpath), interpreter)
    if path is None:
        raise ValueError(
            f"py-spy not found on PATH or in {os.path.dirname(interpreter)} "
            "(pip install 'elastic-supervisor[hang-dump]')"
        )
    refusal = ptrace_refusal(_ptrace_scope(), os.geteuid(), _capabilities(), _file_caps(path))
    if refusal is not None:
        raise ValueError(f"{path} cannot attach to workers: {refusal}")
    return msgspec.structs.replace(spec, py_spy=path)


def find_py_spy(path: str, interpreter: str) -> str | None:
    """``py-spy`` on ``path``, else in the interpreter's own directory; None if neither."""
    found = shutil.which("py-spy", path=path)
    if found is not None:
        return os.path.abspath(found)
    beside = os.path.join(os.path.dirname(os.path.abspath(interpreter)), "py-spy")
    return beside if os.path.isfile(beside) and os.access(beside, os.X_OK) else None


CAP_SYS_PTRACE = 19


def ptrace_refusal(
    scope: int | None, euid: int, caps: tuple[int, int], file_caps: bool
) -> str | None:
    """Why py-spy, our child, could not ptrace a worker (its sibling), or None if it can.

    ``scope``: Yama's ``kernel.yama.ptrace_scope`` (None without Yama); ``caps``: our
    bounding and ambient capability sets; ``file_caps``: py-spy carries file capabilities
    (``setcap``), which we do not try to read. Scope 0 (and no Yama) lets a process trace
    any of its uid; 1 only its descendants, 2 only with CAP_SYS_PTRACE: py-spy is no
    ancestor of the worker, so both need the capability; 3 forbids ptrace altogether."""
    if scope is None or scope <= 0:
        return None
    if scope >= 3:
        return "kernel.yama.ptrace_scope=3 forbids ptrace altogether"
    bounding, ambient = caps
    # after exec, root's capabilities are the bounding set; a user keeps the ambient ones
    inherited = bounding if euid == 0 else ambient
    if inherited >> CAP_SYS_PTRACE & 1 or file_caps:
        return None
    return (f"kernel.yama.ptrace_scope={scope} needs CAP_SYS_PTRACE, which py-spy would not "
            "have (set the sysctl to 0 or give AmbientCapabilities=CAP_SYS_PTRACE)")


def _ptrace_scope() -> int | None:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope", "rb") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _capabilities() -> tuple[int, int]:
    """Our bounding and ambient capability sets (all zero if unreadable)."""
    found = {b"CapBnd:": 0, b"CapAmb:": 0}
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                key, _, value = line.partition(b"\t")
                if key in found:
                    found[key] = int(value.strip(), 16)
    except (OSError, ValueError):
        pass
    return found[b"CapBnd:"], found[b"CapAmb:"]


def _file_caps(path: str) -> bool:
    try:
        return bool(os.getxattr(path, "security.capability"))
    except OSError:
        return False


def _parse_signal(name: str) -> int:
    if name.isdigit():
        number = int(name)
    else:
        try:
            number = int(signal.Signals[name if name.startswith("SIG") else "SIG" + name])
        except KeyError:
            raise ValueError(f"unknown signal {name!r}") from None
    if not 1 <= number <= 64 or number in (signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(f"signal {name!r} cannot trigger a dump")
    return number


class ExpiryOutcome(enum.StrEnum):
    """What became of a worker whose deadline expired; stable metrics labels."""

    EXITED = "exited"  # died after the requested signal
    KILLED = "killed"  # needed SIGKILL (or SIGKILL was requested)
    GONE = "gone"  # already dead when we came to signal it
    DISOWNED = "disowned"  # no longer a worker of the current attempt: left alone


class ProcessHandle:
    """A pidfd on one process: signals and exit waits that cannot hit a reused pid."""

    def __init__(self, pid: int, fd: int) -> None:
        self.pid = pid
        self._fd = fd

    @classmethod
    def open(cls, pid: int) -> ProcessHandle | None:
        """A handle on ``pid``, or None if no such process exists."""
        try:
            return cls(pid, os.pidfd_open(pid))
        except ProcessLookupError:
            return None

    def send(self, signum: int) -> bool:
        """Send a signal; False if the process is gone."""
        try:
            signal.pidfd_send_signal(self._fd, signum)
        except ProcessLookupError:
            return False
        return True

    def exited(self) -> bool:
        """Whether the process has exited (a pidfd turns readable at exit)."""
        poller = select.poll()  # not select(): fds above 1023 are fine
        poller.register(self._fd, select.POLLIN)
        return bool(poller.poll(0))

    async def wait_exit(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the process to exit; returns whether it did."""
        if self.exited():
            return True
        with anyio.move_on_after(timeout):
            await anyio.wait_readable(self._fd)  # a pidfd turns readable at exit
            return True
        return False

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ProcessHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


async def terminate(
    handle: ProcessHandle, signum: int, grace: float, still_owned: Callable[[], bool]
) -> ExpiryOutcome:
    """Send ``signum``, then SIGKILL after ``grace`` if it is still alive and still ours."""
    if not still_owned():
        return ExpiryOutcome.DISOWNED
    if not handle.send(signum):
        return ExpiryOutcome.GONE
    if signum == signal.SIGKILL:
        return ExpiryOutcome.KILLED
    if await handle.wait_exit(grace):
        return ExpiryOutcome.EXITED
    if not still_owned():
        return ExpiryOutcome.DISOWNED
    logger.warning("pid %d survived %s for %.1f s: sending SIGKILL",
                   handle.pid, signal.Signals(signum).name, grace)
    return ExpiryOutcome.KILLED if handle.send(signal.SIGKILL) else ExpiryOutcome.GONE


async def dump_hang(handle: ProcessHandle, spec: HangDump, path: Path | None) -> None:
    """Capture where a hung process is, bounded by ``spec.timeout``; never raises."""
    if spec.mode == "signal":
        logger.info("asking pid %d for a stack dump with %s", handle.pid,
                    signal.Signals(spec.signum).name)
        if handle.send(spec.signum):
            await handle.wait_exit(spec.signal_wait)  # time to write it; done if it died
    elif spec.mode == "py-spy":
        try:
            await _py_spy_dump(handle.pid, spec, path)
        except OSError as exc:
            logger.warning("py-spy dump of pid %d failed: %s", handle.pid, exc)


async def _py_spy_dump(pid: int, spec: HangDump, path: Path | None) -> None:
    command = [spec.py_spy, "dump", "--pid", str(pid)]
    if path is None:
        result = await _run_bounded(command, subprocess.PIPE, spec.timeout)
        if result:
            logger.warning("hang dump of pid %d:\n%s", pid, result.decode(errors="replace"))
        return
    # stacks can hold secrets: readable by the service's group at most, like the logs; in
    # the rank's directory, which its worker can write: a new regular file, never through
    # a link or into a FIFO it planted, opened off the loop (safepaths)
    fd = await anyio.to_thread.run_sync(open_in_dir, path, CREATE_NEW, 0o640)
    try:
        with open(fd, "wb") as out:
            await _run_bounded(command, out.fileno(), spec.timeout)
    except OSError:
        path.unlink(missing_ok=True)  # no empty file that looks like a dump
        raise
    logger.warning("hang dump of pid %d saved to %s", pid, path)


async def _run_bounded(command: list[str], stdout: int, timeout: float) -> bytes:
    """Run a command for at most ``timeout`` seconds; returns what it printed if piped."""
    async with await anyio.open_process(
        command, stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.STDOUT
    ) as proc:
        output = b""
        with anyio.move_on_after(timeout) as scope:
            if proc.stdout is not None:
                output = await _read_all(proc.stdout)
            await proc.wait()
        if scope.cancelled_caught:
            logger.warning("%s did not finish in %.1f s: killed", command[0], timeout)
            proc.kill()
        return output


async def _read_all(stream: anyio.abc.ByteReceiveStream, limit: int = 1 << 20) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in stream:
        if size < limit:
            chunks.append(chunk)
            size += len(chunk)
    return b"".join(chunks)[:limit]
