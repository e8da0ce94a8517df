"""Worker-side helpers: post deadlines and heartbeats to the supervisor's watchdog.

Stdlib only, so a training script can import it for free. The wire format is the one of
torch's ``FileTimerClient``, written to the FIFO named by ``TORCHELASTIC_TIMER_FILE``::

    from supervisor.worker import expires, heartbeat

    for batch in loader:
        with expires(after=300, scope="step"):   # killed if one step takes > 5 min
            train_step(batch)
        heartbeat()                               # progress, without a deadline

Without a supervisor (variable unset, nobody reading the FIFO) both are no-ops, with one
warning, so the same script runs under plain ``python``.
"""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import json
import logging
import os
import select
import signal as _signal
import stat
import sys
import threading
import time
from collections.abc import Iterator

logger = logging.getLogger(__name__)

TIMER_FILE_ENV = "TORCHELASTIC_TIMER_FILE"
HEARTBEAT_SCOPE = "supervisor.heartbeat"
PIPE_BUF = 4096  # longest line the watchdog accepts (atomic on a FIFO)
_FULL_PIPE_WAIT_MS = 1000  # how long to wait for room when the FIFO is full


class TimerClient:
    """Writes deadline requests to one FIFO; thread-safe; never blocks for long.

    The FIFO stays open between requests. If the FIFO is full (the supervisor is slow)
    a request waits up to one second for room, since a lost release would kill a healthy
    worker; if it cannot be sent it is dropped with a warning.
    """

    def __init__(self, path: str | None) -> None:
        self._path = path
        self._fd = -1
        self._lock = threading.Lock()
        self._warned = False

    def acquire(self, scope: str, expiration_time: float, signal: int = _signal.SIGKILL) -> None:
        """Ask to be sent ``signal`` if ``scope`` is not released by ``expiration_time``."""
        if not 1 <= signal <= 64:
            raise ValueError(f"signal must be 1..64, not {signal}")
        self._send(scope, expiration_time, signal)

    def release(self, scope: str) -> None:
        """Cancel the deadline of ``scope`` (also counts as progress)."""
        self._send(scope, -1, 0)

    def heartbeat(self) -> None:
        """Report progress without setting a deadline."""
        self.release(HEARTBEAT_SCOPE)

    @contextlib.contextmanager
    def expires(
        self, after: float, scope: str, signal: int = _signal.SIGKILL
    ) -> Iterator[None]:
        """A deadline ``after`` seconds from now around the block."""
        self.acquire(scope, time.time() + after, signal)
        try:
            yield
        finally:
            self.release(scope)

    def close(self) -> None:
        with self._lock:
            self._close()

    def _send(self, scope: str, expiration_time: float, signal: int) -> None:
        line = _encode(os.getpid(), scope, expiration_time, signal)
        with self._lock:
            if self._fd < 0 and not self._open():
                return
            try:
                self._write(line)
            except OSError as exc:  # the supervisor went away: try a fresh open once
                self._close()
                if not self._open():
                    return
                try:
                    self._write(line)
                except OSError:
                    self._warn_once("could not post a deadline request: %s", exc)

    def _open(self) -> bool:
        if not self._path:
            self._warn_once("%s is not set: deadlines and heartbeats are ignored", TIMER_FILE_ENV)
            return False
        try:
            fd = os.open(self._path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:  # ENXIO: nobody reads it; ENOENT: no such FIFO
            self._warn_once("no watchdog at %s (%s): deadlines are ignored", self._path,
                            os.strerror(exc.errno or errno.EIO))
            return False
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.close(fd)
            self._warn_once("%s is not a FIFO: deadlines are ignored", self._path)
            return False
        self._fd = fd
        return True

    def _write(self, line: bytes) -> None:
        try:
            os.write(self._fd, line)
        except BlockingIOError:
            poller = select.poll()
            poller.register(self._fd, select.POLLOUT)
            if not poller.poll(_FULL_PIPE_WAIT_MS):
                self._warn_once("the watchdog FIFO is full: a deadline request was dropped")
                return
            os.write(self._fd, line)

    def _close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _warn_once(self, msg: str, *args: object) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(msg, *args)


def _encode(pid: int, scope: str, expiration_time: float, signal: int) -> bytes:
    obj = {
        "version": 1,
        "pid": pid,
        "scope_id": scope,
        "expiration_time": expiration_time,
        "signal": signal,
    }
    line = json.dumps(obj).encode() + b"\n"
    if len(line) - 1 > PIPE_BUF:
        raise ValueError(f"scope too long: the request is {len(line)} bytes")
    return line


_default: TimerClient | None = None
_default_lock = threading.Lock()


def default_client() -> TimerClient:
    """The client for ``TORCHELASTIC_TIMER_FILE``, made on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = TimerClient(os.environ.get(TIMER_FILE_ENV))
        return _default


def expires(
    after: float, scope: str | None = None, signal: int = _signal.SIGKILL
) -> contextlib.AbstractContextManager[None]:
    """Ask the supervisor to send ``signal`` unless the block ends within ``after`` seconds.

    ``scope`` names the deadline (default: the caller's ``file#line``, like torch).
    """
    if scope is None:
        caller = sys._getframe(1)
        scope = f"{caller.f_code.co_filename}#{caller.f_lineno}"
    return default_client().expires(after, scope, signal)


def heartbeat() -> None:
    """Tell the supervisor this worker is making progress (no deadline)."""
    default_client().heartbeat()


def enable_hang_dump(signum: int = _signal.SIGUSR1) -> None:
    """Dump all threads' stacks to stderr on ``signum`` (for ``--hang-dump signal:...``)."""
    faulthandler.register(signum, all_threads=True)
