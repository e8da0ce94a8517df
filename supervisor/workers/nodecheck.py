"""Run the node check: the built-in checks, then ``--node-check CMD`` (no shell).

The command runs in a session of its own (``start_new_session``, never ``preexec_fn``),
awaited on the event loop without blocking it; on its timeout or when the caller stops
(cancellation), its whole process group is killed and the leader reaped. Its combined
stdout and stderr are read to the end (a check that prints a lot must not block on a full
pipe) but only the first ``OUTPUT_LIMIT`` bytes are kept; the reason of a failure is their
first non-empty line. Exit 0 is healthy; anything else, or a timeout, is not.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import anyio
from anyio.abc import Process

from supervisor.core.nodehealth import CheckResult, check_failure_reason, disk_verdict

logger = logging.getLogger(__name__)

OUTPUT_LIMIT = 64 * 1024
NOT_RUNNABLE = (126, 127)  # the shell's "not executable" and "not found"


class NodeCheckConfigError(Exception):
    """The check command cannot run at all (not found, not executable): a setting error."""


class NodeChecker:
    """One node's checks: built in (the log directory) and the configured command."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], timeout: float,
                 log_dir: Path) -> None:
        self.argv = list(argv)
        self.env = dict(env)
        self.timeout = timeout
        self.log_dir = log_dir
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
            code, timed_out, output = await run_command(self.argv, self.env, self.timeout)
            if code in NOT_RUNNABLE and self.runs == 1:  # at start: a setting, not the node
                raise NodeCheckConfigError(
                    f"node_check: {self.argv[0]!r} exited with {code} "
                    f"({'not executable' if code == 126 else 'not found'}): "
                    f"{check_failure_reason(code, False, self.timeout, output)}")
            if code != 0:
                reason = check_failure_reason(code, timed_out, self.timeout, output)
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
                      limit: int = OUTPUT_LIMIT) -> tuple[int | None, bool, bytes]:
    """(exit code, timed out, the first ``limit`` bytes of its output). A program that
    cannot be started is exit 127 (not found) or 126 (not executable), as from a shell."""
    try:
        process = await anyio.open_process(
            list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, env=dict(env), start_new_session=True)
    except FileNotFoundError as exc:
        return 127, False, str(exc).encode()
    except PermissionError as exc:
        return 126, False, str(exc).encode()
    except OSError as exc:
        return 126, False, str(exc).encode()
    kept = bytearray()
    try:
        with anyio.move_on_after(timeout) as scope:
            assert process.stdout is not None
            async for chunk in process.stdout:
                if len(kept) < limit:
                    kept += chunk[: limit - len(kept)]
            await process.wait()
        if scope.cancelled_caught:
            return None, True, bytes(kept)
        return process.returncode, False, bytes(kept)
    finally:
        with anyio.CancelScope(shield=True):
            await _kill_group(process)


async def _kill_group(process: Process) -> None:
    """SIGKILL the check's process group (what it left behind too), then reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone
        os.killpg(process.pid, signal.SIGKILL)
    await process.wait()
    await process.aclose()
