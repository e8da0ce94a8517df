"""Driving a real watchdog: its FIFO, deadline requests, and processes frozen in D state."""

from __future__ import annotations

import errno
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream

from supervisor.core.deadlines import TimerRequest, encode_request
from supervisor.core.state import DeadlineExpired
from supervisor.core.statusview import ProgressTable
from supervisor.watchdog.timers import Watchdog, WatchdogConfig

WAIT = 15.0  # bound on any single wait of a watchdog test


class Recorder:
    """A ``WatchdogMetrics`` that tests can wait on."""

    def __init__(self) -> None:
        self.accepted = 0
        self.rejected: Counter[str] = Counter()
        self.expired: Counter[str] = Counter()
        self._changed = anyio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def request_accepted(self) -> None:
        self.accepted += 1
        self._notify()

    def request_rejected(self, reason: str) -> None:
        self.rejected[reason] += 1
        self._notify()

    def deadline_expired(self, outcome: str) -> None:
        self.expired[outcome] += 1
        self._notify()

    async def until(self, predicate: Callable[[], bool]) -> None:
        with anyio.fail_after(WAIT):
            while True:
                changed = self._changed
                if predicate():
                    return
                await changed.wait()


@dataclass
class Harness:
    watchdog: Watchdog
    metrics: Recorder
    progress: ProgressTable
    expired: MemoryObjectReceiveStream[DeadlineExpired]
    fifo: Path
    owned: dict[int, int]

    async def next_expiry(self) -> DeadlineExpired:
        with anyio.fail_after(WAIT):
            return await self.expired.receive()


@asynccontextmanager
async def running_watchdog(
    fifo: Path,
    config: WatchdogConfig | None = None,
    owner: Callable[[int], int | None] | None = None,
) -> AsyncIterator[Harness]:
    """A watchdog tailing ``fifo`` in this event loop; ``owner`` says whose pid is whose
    (by default the ``owned`` map of the harness)."""
    owned: dict[int, int] = {}
    progress = ProgressTable()
    metrics = Recorder()
    send, receive = anyio.create_memory_object_stream[DeadlineExpired](16)
    watchdog = Watchdog(
        fifo, owner or owned.get, progress, send.send,
        config or WatchdogConfig(kill_grace=0.5), metrics,
    )
    with send, receive:
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(WAIT):
                path = await tg.start(watchdog.run)
            yield Harness(watchdog, metrics, progress, receive, path, owned)
            tg.cancel_scope.cancel()


def post(fifo: Path, data: bytes) -> None:
    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def request(pid: int, after: float = 0.0, signum: int = signal.SIGKILL, scope: str = "s") -> bytes:
    return encode_request(TimerRequest(pid, scope, time.time() + after, signum))


class Freezer:
    """A cgroup v1 freezer child group: processes moved in and FROZEN sleep in D."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.group = root / f"esv-test-{uuid.uuid4().hex[:12]}"
        self.group.mkdir()

    def freeze(self, pid: int) -> None:
        (self.group / "cgroup.procs").write_text(str(pid))
        (self.group / "freezer.state").write_text("FROZEN")

    def release(self, *, wait: float = 0.0) -> None:
        """Thaw, move the processes out and remove the group. A worker that exited is a
        zombie until its supervisor reaps it and keeps the group busy (EBUSY) until then:
        the group is then removed by a later call, which tries for ``wait`` seconds."""
        if not self.group.exists():
            return
        (self.group / "freezer.state").write_text("THAWED")
        deadline = time.monotonic() + wait
        while True:
            for pid in (self.group / "cgroup.procs").read_text().split():
                try:
                    (self.root / "cgroup.procs").write_text(pid)
                except OSError as exc:  # exited meanwhile
                    if exc.errno != errno.ESRCH:
                        raise
            try:
                self.group.rmdir()
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise
                if time.monotonic() >= deadline:
                    if wait:
                        raise
                    return  # removed by the fixture's final call
            time.sleep(0.05)  # cgroup v1 announces no emptiness (only a release agent)


def proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]
