"""The watchdog against a real FIFO and real processes.

Fake workers are real interpreters (``sys.executable``) running ``WORKER`` in a mode. Each
waits for ``go`` on stdin (so the test can register it as a worker first), sets itself
up, and prints ``ready``; tests synchronise on that line and on the watchdog's counters,
every wait bounded by ``fail_after``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import termios
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import psutil
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

import supervisor.worker as worker_module
from supervisor.core.deadlines import PIPE_BUF, TimerRequest, encode_request, parse_request
from supervisor.core.state import WorkerUnhealthy
from supervisor.watchdog.dstate import DSample, DStateMonitor, DStateTracker, sample_d_state
from supervisor.watchdog.escalate import (
    ExpiryOutcome,
    HangDump,
    ProcessHandle,
    dump_hang,
    find_py_spy,
    terminate,
)
from supervisor.watchdog.fifo import (
    FifoError,
    LineBuffer,
    create_fifo,
    open_fifo,
    open_fifo_reader,
)
from supervisor.watchdog.owners import owner_by_ancestry
from supervisor.watchdog.timers import RateLimitedLog, WatchdogConfig
from supervisor.worker import HEARTBEAT_SCOPE, TimerClient
from tests.support.paths import REPO, WORKERS
from tests.support.watchdog import (
    WAIT,
    Freezer,
    post,
    proc_state,
    request,
    running_watchdog,
)

WORKER = (WORKERS / "watchdog_worker.py").read_text()


# ------------------------------------------------------------------------- helpers


class Child:
    """A fake worker process and its stdout lines."""

    def __init__(self, process: anyio.abc.Process) -> None:
        self.process = process
        assert process.stdout is not None
        self._out = BufferedByteReceiveStream(process.stdout)

    @property
    def pid(self) -> int:
        return self.process.pid

    async def line(self) -> str:
        with anyio.fail_after(WAIT):
            return (await self._out.receive_until(b"\n", 4096)).decode()

    async def wait(self) -> int:
        with anyio.fail_after(WAIT):
            return await self.process.wait()

    def alive(self) -> bool:
        return self.process.returncode is None and _pid_running(self.pid)


def _pid_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


SpawnFn = Callable[..., Any]


@pytest.fixture
async def spawn(tmp_path: Path) -> AsyncIterator[SpawnFn]:
    """Factory: start a fake worker; registers it in ``owned`` before it posts anything."""
    children: list[Child] = []

    async def start(
        mode: str,
        *args: str,
        fifo: Path | None = None,
        owned: dict[int, int] | None = None,
        rank: int = 0,
    ) -> Child:
        env = {**os.environ, "PYTHONPATH": str(REPO), "WORKER": WORKER}
        env["TORCHELASTIC_TIMER_FILE"] = str(fifo or tmp_path / "no-such-fifo")
        process = await anyio.open_process(
            [sys.executable, "-c", WORKER, mode, *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, env=env,
            start_new_session=True,  # its own process group: teardown kills grandchildren too
        )
        child = Child(process)
        children.append(child)
        if owned is not None:
            owned[child.pid] = rank
        assert process.stdin is not None
        await process.stdin.send(b"go\n")
        if mode == "grandchild":
            return child  # the test reads the grandchild's pid, then ready
        assert await child.line() == "ready"
        return child

    yield start
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        with anyio.fail_after(WAIT):
            await child.process.aclose()












async def wait_until(predicate: Callable[[], bool]) -> None:
    """For kernel or internal states that announce nothing (FIFO drained, D state)."""
    with anyio.fail_after(WAIT):
        while not predicate():
            await anyio.sleep(0.005)


def fifo_unread(path: Path) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    try:
        buf = fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0")
        return int.from_bytes(buf, sys.byteorder)
    finally:
        os.close(fd)


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    return tmp_path / "watchdog" / "timer.fifo"


# ------------------------------------------------------------------------ framing


def test_line_buffer_splits_lines() -> None:
    buffer = LineBuffer(16)
    assert buffer.feed(b"a\nbb\n\nccc\n") == ([b"a", b"bb", b"ccc"], 0)


def test_line_buffer_keeps_half_written_line_until_completed() -> None:
    buffer = LineBuffer(16)
    assert buffer.feed(b"abc") == ([], 0)
    assert buffer.pending == 3
    assert buffer.feed(b"de") == ([], 0)
    assert buffer.feed(b"f\ng") == ([b"abcdef"], 0)
    assert buffer.pending == 1


def test_line_buffer_drops_oversized_line_and_resyncs() -> None:
    buffer = LineBuffer(8)
    assert buffer.feed(b"ok\n" + b"x" * 20) == ([b"ok"], 1)
    assert buffer.pending == 0  # bounded: nothing of the long line is held
    assert buffer.feed(b"y" * 20) == ([], 0)  # still the same long line: counted once
    assert buffer.feed(b"zz\nafter\n") == ([b"after"], 0)


def test_line_buffer_line_of_exactly_max_is_kept() -> None:
    buffer = LineBuffer(8)
    assert buffer.feed(b"12345678\n123456789\n") == ([b"12345678"], 1)


def test_line_buffer_oversized_across_feeds() -> None:
    buffer = LineBuffer(8)
    assert buffer.feed(b"12345") == ([], 0)
    assert buffer.feed(b"6789") == ([], 1)
    assert buffer.feed(b"\nnext\n") == ([b"next"], 0)


# --------------------------------------------------------------------------- FIFO


def test_fifo_is_private(fifo: Path) -> None:
    create_fifo(fifo)
    assert stat.S_IMODE(os.stat(fifo.parent).st_mode) == 0o700
    st = os.lstat(fifo)
    assert stat.S_ISFIFO(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600


def test_fifo_modes_ignore_a_permissive_umask(fifo: Path) -> None:
    old = os.umask(0)
    try:
        create_fifo(fifo)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(fifo.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(fifo).st_mode) == 0o600


def test_stale_fifo_is_replaced(fifo: Path) -> None:
    create_fifo(fifo)
    os.chmod(fifo, 0o644)
    old = os.open(fifo, os.O_RDWR)  # keeps the old inode from being reused
    try:
        create_fifo(fifo)
        assert os.lstat(fifo).st_ino != os.fstat(old).st_ino
        assert stat.S_IMODE(os.lstat(fifo).st_mode) == 0o600
    finally:
        os.close(old)


def test_regular_file_at_fifo_path_is_refused_and_kept(fifo: Path) -> None:
    fifo.parent.mkdir(mode=0o700)
    fifo.write_text("precious")
    with pytest.raises(FifoError, match="not a FIFO"):
        create_fifo(fifo)
    assert fifo.read_text() == "precious"


def test_symlink_at_fifo_path_is_refused(fifo: Path, tmp_path: Path) -> None:
    fifo.parent.mkdir(mode=0o700)
    target = tmp_path / "target"
    os.mkfifo(target)
    fifo.symlink_to(target)
    with pytest.raises(FifoError):
        create_fifo(fifo)


def test_directory_open_to_others_is_refused(fifo: Path) -> None:
    fifo.parent.mkdir()
    os.chmod(fifo.parent, 0o755)
    with pytest.raises(FifoError, match="open to other users"):
        create_fifo(fifo)


def test_symlinked_directory_is_refused(fifo: Path, tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    fifo.parent.symlink_to(real)
    with pytest.raises(FifoError, match="not a directory"):
        create_fifo(fifo)


def test_open_never_blocks_and_never_sees_eof(fifo: Path) -> None:
    create_fifo(fifo)
    fd = open_fifo(fifo)  # no writer yet: a plain open would block here
    try:
        post(fifo, b"x\n")  # a writer comes and goes
        assert os.read(fd, 100) == b"x\n"
        with pytest.raises(BlockingIOError):
            os.read(fd, 100)  # empty and no writer: EAGAIN, not EOF
    finally:
        os.close(fd)


async def test_reader_removes_fifo_and_created_dir_on_exit(fifo: Path) -> None:
    async with open_fifo_reader(fifo) as reader:
        assert stat.S_ISFIFO(os.lstat(reader.path).st_mode)
    assert not fifo.exists()
    assert not fifo.parent.exists()


async def test_reader_returns_lines_and_counts_oversized(fifo: Path) -> None:
    async with open_fifo_reader(fifo) as reader:
        post(fifo, b"one\n" + b"x" * (PIPE_BUF + 10) + b"\ntwo\n")
        lines: list[bytes] = []
        oversized = 0
        with anyio.fail_after(WAIT):
            while len(lines) < 2:
                batch = await reader.receive()
                lines += batch.lines
                oversized += batch.oversized
    assert lines == [b"one", b"two"]
    assert oversized == 1


# ------------------------------------------------------------------------ the tailer


async def test_started_only_once_fifo_is_open(fifo: Path) -> None:
    async with running_watchdog(fifo) as h:
        assert h.fifo == fifo
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO if nobody were reading
        os.close(fd)
        assert stat.S_IMODE(os.stat(fifo).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(fifo.parent).st_mode) == 0o700
    assert not fifo.exists()


async def test_expiry_reports_and_kills_worker(fifo: Path, spawn: SpawnFn) -> None:
    async with running_watchdog(fifo) as h:
        child = await spawn("deadline", "0.2", str(signal.SIGTERM), fifo=fifo, owned=h.owned,
                            rank=3)
        event = await h.next_expiry()
        assert (event.local_rank, event.pid, event.scope) == (3, child.pid, "step")
        assert event.late >= 0
        assert await child.wait() == -signal.SIGTERM
        await h.metrics.until(lambda: h.metrics.expired[ExpiryOutcome.EXITED] == 1)
        assert h.watchdog.deadlines() == []


async def test_worker_ignoring_the_signal_is_killed_after_grace(
    fifo: Path, spawn: SpawnFn
) -> None:
    async with running_watchdog(fifo, WatchdogConfig(kill_grace=0.3)) as h:
        child = await spawn("deadline", "0", str(signal.SIGTERM), "ignore-term", fifo=fifo,
                            owned=h.owned)
        await h.next_expiry()
        assert await child.wait() == -signal.SIGKILL
        await h.metrics.until(lambda: h.metrics.expired[ExpiryOutcome.KILLED] == 1)


async def test_release_before_deadline_does_nothing(fifo: Path, spawn: SpawnFn) -> None:
    async with running_watchdog(fifo) as h:
        child = await spawn("release", "0.3", fifo=fifo, owned=h.owned, rank=1)
        await h.metrics.until(lambda: h.metrics.accepted == 2)  # acquire, release
        assert h.watchdog.deadlines() == []  # nothing left that could fire
        assert child.alive()
        assert not h.metrics.rejected
        assert set(h.progress.view()) == {1}


async def test_each_accepted_request_is_progress(fifo: Path, spawn: SpawnFn) -> None:
    async with running_watchdog(fifo) as h:
        child = await spawn("heartbeat", fifo=fifo, owned=h.owned, rank=2)
        await h.metrics.until(lambda: h.metrics.accepted == 1)
        first = h.progress.view()[2]
        post(fifo, encode_request(TimerRequest(child.pid, HEARTBEAT_SCOPE, -1, 0)))
        await h.metrics.until(lambda: h.metrics.accepted == 2)
        assert h.progress.view()[2] > first
        assert h.watchdog.deadlines() == []


async def test_forged_request_for_a_non_worker_is_rejected(
    fifo: Path, spawn: SpawnFn
) -> None:
    async with running_watchdog(fifo) as h:
        bystander = await spawn("ignore-term")  # a live process that is no worker
        post(fifo, request(bystander.pid, after=-10))
        await h.metrics.until(lambda: h.metrics.rejected["not_owned"] == 1)
        assert h.watchdog.deadlines() == []
        # a real worker's expiry proves the timer ran past the forged deadline
        await spawn("deadline", "0", str(signal.SIGKILL), fifo=fifo, owned=h.owned)
        await h.next_expiry()
        assert bystander.alive()
        assert h.progress.view().keys() == {0}


async def test_request_naming_the_supervisor_is_rejected(fifo: Path) -> None:
    me = os.getpid()
    async with running_watchdog(fifo, owner=lambda pid: 0) as h:  # even if "owned"
        post(fifo, request(me, after=-10))
        await h.metrics.until(lambda: h.metrics.rejected["supervisor_pid"] == 1)
        assert h.watchdog.deadlines() == []


async def test_request_from_a_dead_pid_is_rejected(fifo: Path, spawn: SpawnFn) -> None:
    child = await spawn("ignore-term")
    child.process.kill()
    await child.wait()
    async with running_watchdog(fifo) as h:
        post(fifo, request(child.pid, after=60))
        await h.metrics.until(lambda: h.metrics.rejected["dead_pid"] == 1)


async def test_garbage_and_oversized_lines_are_counted_and_harmless(
    fifo: Path, spawn: SpawnFn
) -> None:
    async with running_watchdog(fifo) as h:
        child = await spawn("ignore-term", owned=h.owned)
        post(fifo, b"garbage\n{}\n[1]\n\xff\xfe\n")
        post(fifo, b"{" + b"x" * (3 * PIPE_BUF) + b"\n")
        post(fifo, json.dumps({"version": 1, "pid": True}).encode() + b"\n")
        await h.metrics.until(lambda: sum(h.metrics.rejected.values()) == 6)
        assert h.metrics.rejected == {
            "malformed": 2, "missing_field": 1, "not_object": 1, "oversized": 1, "bad_type": 1
        }
        post(fifo, request(child.pid, after=60))
        await h.metrics.until(lambda: h.metrics.accepted == 1)
        assert [pid for pid, _, _ in h.watchdog.deadlines()] == [child.pid]


async def test_half_written_line_waits_for_its_end(fifo: Path, spawn: SpawnFn) -> None:
    async with running_watchdog(fifo) as h:
        child = await spawn("ignore-term", owned=h.owned)
        line = request(child.pid, after=60)
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(fd, line[:20])
            await wait_until(lambda: fifo_unread(fifo) == 0)  # the tailer took the half
            assert h.metrics.accepted == 0
            assert not h.metrics.rejected
            os.write(fd, line[20:])
        finally:
            os.close(fd)
        await h.metrics.until(lambda: h.metrics.accepted == 1)
        assert not h.metrics.rejected


async def test_nearer_deadline_wakes_the_timer(fifo: Path, spawn: SpawnFn) -> None:
    async with running_watchdog(fifo) as h:
        far = await spawn("deadline", "600", str(signal.SIGKILL), fifo=fifo, owned=h.owned,
                          rank=0)
        await h.metrics.until(lambda: h.metrics.accepted == 1)
        near = await spawn("deadline", "0.2", str(signal.SIGKILL), fifo=fifo, owned=h.owned,
                           rank=1)
        event = await h.next_expiry()  # long before the 600 s timer
        assert event.pid == near.pid
        assert await near.wait() == -signal.SIGKILL
        assert far.alive()


async def test_reset_drops_deadlines_of_the_last_attempt(fifo: Path, spawn: SpawnFn) -> None:
    async with running_watchdog(fifo) as h:
        await spawn("deadline", "600", str(signal.SIGKILL), fifo=fifo, owned=h.owned)
        await h.metrics.until(lambda: h.metrics.accepted == 1)
        h.watchdog.reset(2)
        assert h.watchdog.deadlines() == []
        assert h.watchdog.attempt == 2


async def test_forget_pid_drops_its_deadlines(fifo: Path, spawn: SpawnFn) -> None:
    async with running_watchdog(fifo) as h:
        child = await spawn("deadline", "600", str(signal.SIGKILL), fifo=fifo, owned=h.owned)
        await h.metrics.until(lambda: h.metrics.accepted == 1)
        h.watchdog.forget_pid(child.pid)
        assert h.watchdog.deadlines() == []


async def test_expiry_of_a_worker_no_longer_owned_is_ignored(
    fifo: Path, spawn: SpawnFn
) -> None:
    async with running_watchdog(fifo) as h:
        child = await spawn("deadline", "0.3", str(signal.SIGKILL), fifo=fifo, owned=h.owned)
        await h.metrics.until(lambda: h.metrics.accepted == 1)
        del h.owned[child.pid]  # the controller no longer counts it as a worker
        await h.metrics.until(lambda: h.metrics.expired[ExpiryOutcome.DISOWNED] == 1)
        assert child.alive()


async def test_descendant_deadline_signals_the_descendant(fifo: Path, spawn: SpawnFn) -> None:
    workers: dict[int, int] = {}
    async with running_watchdog(fifo, owner=lambda pid: owner_by_ancestry(pid, workers)) as h:
        child = await spawn("grandchild", "deadline", "0.2", str(signal.SIGKILL), fifo=fifo,
                            owned=workers, rank=5)
        grandchild = int((await child.line()).split()[1])
        assert await child.line() == "ready"
        event = await h.next_expiry()
        assert (event.pid, event.local_rank) == (grandchild, 5)
        await wait_until(lambda: not _pid_running(grandchild))
        assert child.alive()


async def test_clear_cancels_an_escalation_in_progress(fifo: Path, spawn: SpawnFn) -> None:
    dump = HangDump("signal", signal.SIGUSR1, signal_wait=WAIT * 4)
    async with running_watchdog(fifo, WatchdogConfig(hang_dump=dump)) as h:
        child = await spawn("usr1", owned=h.owned)
        post(fifo, request(child.pid, after=0))
        assert await child.line() == "usr1"  # the escalation is in its dump phase
        h.watchdog.clear()
        # a later expiry (its worker dies of the SIGUSR1 dump request) proves the
        # cancelled escalation has had every chance to signal or report
        other = await spawn("ignore-term", owned=h.owned)
        post(fifo, request(other.pid, after=0))
        event = await h.next_expiry()
        assert event.pid == other.pid
        assert child.alive()


async def test_hang_dump_runs_before_the_worker_is_signalled(
    fifo: Path, spawn: SpawnFn, tmp_path: Path
) -> None:
    fake = fake_py_spy(tmp_path)
    dumps = tmp_path / "dumps"  # a rank directory of the job's: it exists, and is private
    dumps.mkdir(mode=0o700)
    config = WatchdogConfig(
        kill_grace=0.5,
        hang_dump=HangDump("py-spy", timeout=WAIT, py_spy=str(fake)),
        dump_path=lambda rank, pid: dumps / f"rank{rank}-{pid}.txt",
    )
    async with running_watchdog(fifo, config) as h:
        child = await spawn("deadline", "0", str(signal.SIGKILL), fifo=fifo, owned=h.owned,
                            rank=1)
        await h.next_expiry()
        assert await child.wait() == -signal.SIGKILL
    text = (dumps / f"rank1-{child.pid}.txt").read_text()
    assert text == f"dump --pid {child.pid} alive\n"


# ---------------------------------------------------------------------- torch client


@pytest.mark.torch
async def test_torch_file_timer_client_expiry_kills_worker(fifo: Path, spawn: SpawnFn) -> None:
    async with running_watchdog(fifo) as h:
        child = await spawn("torch-deadline", "0.5", fifo=fifo, owned=h.owned, rank=4)
        event = await h.next_expiry()
        assert (event.pid, event.local_rank, event.scope) == (child.pid, 4, "torch-step")
        assert await child.wait() == -signal.SIGKILL


@pytest.mark.torch
async def test_torch_file_timer_client_release(fifo: Path, spawn: SpawnFn) -> None:
    async with running_watchdog(fifo) as h:
        child = await spawn("torch-release", fifo=fifo, owned=h.owned, rank=0)
        await h.metrics.until(lambda: h.metrics.accepted == 2)
        assert h.watchdog.deadlines() == []
        assert not h.metrics.rejected  # torch's release carries signal 0: still valid
        assert child.alive()


# ------------------------------------------------------------------------ escalation


def handle_of(pid: int) -> ProcessHandle:
    handle = ProcessHandle.open(pid)
    assert handle is not None
    return handle


async def test_terminate_with_requested_signal(spawn: SpawnFn) -> None:
    child = await spawn("ignore-term")
    with handle_of(child.pid) as handle:
        outcome = await terminate(handle, signal.SIGUSR2, 5.0, lambda: True)
    assert outcome is ExpiryOutcome.EXITED
    assert await child.wait() == -signal.SIGUSR2


async def test_terminate_escalates_to_sigkill(spawn: SpawnFn) -> None:
    child = await spawn("ignore-term")
    with handle_of(child.pid) as handle:
        outcome = await terminate(handle, signal.SIGTERM, 0.2, lambda: True)
    assert outcome is ExpiryOutcome.KILLED
    assert await child.wait() == -signal.SIGKILL


async def test_terminate_leaves_a_disowned_process_alone(spawn: SpawnFn) -> None:
    child = await spawn("ignore-term")
    with handle_of(child.pid) as handle:
        outcome = await terminate(handle, signal.SIGKILL, 0.2, lambda: False)
    assert outcome is ExpiryOutcome.DISOWNED
    assert child.alive()


async def test_process_handle_of_a_reaped_process(spawn: SpawnFn) -> None:
    child = await spawn("ignore-term")
    handle = ProcessHandle.open(child.pid)
    assert handle is not None
    child.process.kill()
    await child.wait()  # reaped: the pid may now be reused, the pidfd cannot be
    with handle:
        assert await handle.wait_exit(0)
        assert not handle.send(signal.SIGKILL)


async def test_signal_hang_dump(spawn: SpawnFn) -> None:
    child = await spawn("usr1")
    with handle_of(child.pid) as handle:
        await dump_hang(handle, HangDump("signal", signal.SIGUSR1, signal_wait=0.01), None)
    assert await child.line() == "usr1"
    assert child.alive()


def fake_py_spy(tmp_path: Path, body: str = "") -> Path:
    """A stand-in for py-spy: prints its arguments and whether the target is alive."""
    script = tmp_path / "py-spy"
    script.write_text(
        f"#!{sys.executable}\n"
        "import os, sys, time\n"
        f"{body}\n"
        "os.kill(int(sys.argv[3]), 0)\n"
        "print(' '.join(sys.argv[1:]), 'alive')\n"
    )
    script.chmod(0o755)
    return script


async def test_py_spy_dump_is_saved(spawn: SpawnFn, tmp_path: Path) -> None:
    child = await spawn("ignore-term")
    (tmp_path / "a").mkdir(mode=0o700)  # the rank's directory, made before any dump
    out = tmp_path / "a" / "dump.txt"
    spec = HangDump("py-spy", timeout=WAIT, py_spy=str(fake_py_spy(tmp_path)))
    with handle_of(child.pid) as handle:
        await dump_hang(handle, spec, out)
    assert out.read_text() == f"dump --pid {child.pid} alive\n"


REAL_PY_SPY = find_py_spy(os.environ.get("PATH", os.defpath), sys.executable)


@pytest.mark.skipif(REAL_PY_SPY is None,
                    reason="py-spy is not installed (pip install elastic-supervisor[hang-dump])")
async def test_real_py_spy_dump(spawn: SpawnFn, tmp_path: Path) -> None:
    assert REAL_PY_SPY is not None
    child = await spawn("ignore-term")
    out = tmp_path / "dump.txt"
    with handle_of(child.pid) as handle:
        await dump_hang(handle, HangDump("py-spy", timeout=WAIT, py_spy=REAL_PY_SPY), out)
    text = out.read_text()
    assert f"Process {child.pid}" in text
    assert "<module>" in text  # the stack of the sleeping script
    assert child.alive()


async def test_py_spy_dump_is_bounded(spawn: SpawnFn, tmp_path: Path) -> None:
    child = await spawn("ignore-term")
    spec = HangDump("py-spy", timeout=0.2, py_spy=str(fake_py_spy(tmp_path, "time.sleep(60)")))
    with anyio.fail_after(5), handle_of(child.pid) as handle:
        await dump_hang(handle, spec, tmp_path / "dump.txt")


async def test_missing_py_spy_is_not_fatal(
    spawn: SpawnFn, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    child = await spawn("ignore-term")
    spec = HangDump("py-spy", py_spy=str(tmp_path / "nowhere"))
    with handle_of(child.pid) as handle:
        await dump_hang(handle, spec, None)
    assert "py-spy dump" in caplog.text


def test_hang_dump_parse() -> None:
    assert HangDump.parse("none").mode == "none"
    assert HangDump.parse("py-spy", timeout=3).timeout == 3
    assert HangDump.parse("signal:SIGUSR1") == HangDump("signal", signal.SIGUSR1)
    assert HangDump.parse("signal:USR2").signum == signal.SIGUSR2
    assert HangDump.parse("signal:12").signum == 12
    for bad in ("", "gdb", "signal:", "signal:SIGKILL", "signal:NOPE", "signal:99"):
        with pytest.raises(ValueError):
            HangDump.parse(bad)


def test_rate_limited_log(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = RateLimitedLog(logging.getLogger("t"), 10.0, clock=lambda: now[0])
    assert log.warning("a", "msg %s", 1)
    assert not log.warning("a", "msg %s", 2)
    assert log.warning("b", "other")
    now[0] = 10.0
    assert log.warning("a", "msg %s", 3)
    assert "msg 3 (1 similar suppressed)" in caplog.text


async def test_owner_by_ancestry(spawn: SpawnFn) -> None:
    child = await spawn("grandchild", "ignore-term")
    grandchild = int((await child.line()).split()[1])
    workers = {child.pid: 7}
    assert owner_by_ancestry(child.pid, workers) == 7
    assert owner_by_ancestry(grandchild, workers) == 7
    assert owner_by_ancestry(os.getpid(), workers) is None
    assert owner_by_ancestry(1, workers) is None
    assert owner_by_ancestry(grandchild, {}) is None


# --------------------------------------------------------------------- worker helper


def test_client_without_timer_file_is_a_quiet_no_op(caplog: pytest.LogCaptureFixture) -> None:
    client = TimerClient(None)
    client.heartbeat()
    with client.expires(5, "s"):
        pass
    assert caplog.text.count("TORCHELASTIC_TIMER_FILE is not set") == 1


def test_client_without_reader_is_a_no_op(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                          ) -> None:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    client = TimerClient(str(path))
    client.heartbeat()
    client.heartbeat()
    assert caplog.text.count("no watchdog") == 1


def test_client_does_not_write_into_a_regular_file(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("")
    TimerClient(str(path)).heartbeat()
    assert path.read_text() == ""


def test_client_rejects_bad_signal_and_huge_scope() -> None:
    client = TimerClient(None)
    with pytest.raises(ValueError):
        client.acquire("s", time.time(), 0)
    with pytest.raises(ValueError):
        client.acquire("s" * PIPE_BUF, time.time())


@pytest.fixture
def reader_fd(fifo: Path) -> Iterator[int]:
    create_fifo(fifo)
    fd = open_fifo(fifo)
    yield fd
    os.close(fd)


def read_requests(fd: int) -> list[TimerRequest]:
    out = []
    for raw in os.read(fd, 1 << 16).splitlines():
        parsed = parse_request(raw)
        assert isinstance(parsed, TimerRequest), parsed
        out.append(parsed)
    return out


def test_module_expires_posts_acquire_and_release(
    fifo: Path, reader_fd: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHELASTIC_TIMER_FILE", str(fifo))
    monkeypatch.setattr(worker_module, "_default", None)
    before = time.time()
    with worker_module.expires(after=30, signal=signal.SIGTERM):
        line = sys._getframe().f_lineno - 1
    acquire, release = read_requests(reader_fd)
    assert acquire.pid == os.getpid()
    assert acquire.scope == f"{__file__}#{line}"  # the caller's file#line, like torch
    assert acquire.signal == signal.SIGTERM
    assert before + 30 <= acquire.expiration_time <= time.time() + 30
    assert release.is_release and release.scope == acquire.scope
    worker_module.heartbeat()
    [beat] = read_requests(reader_fd)
    assert beat.is_release and beat.scope == HEARTBEAT_SCOPE
    worker_module.default_client().close()


def test_client_waits_for_room_then_drops(
    fifo: Path, reader_fd: int, caplog: pytest.LogCaptureFixture
) -> None:
    client = TimerClient(str(fifo))
    client.heartbeat()
    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(BlockingIOError):
            while True:
                os.write(fd, b"x" * PIPE_BUF)  # fill the pipe
    finally:
        os.close(fd)
    started = time.monotonic()
    client.heartbeat()  # waits about a second for room, then gives up
    assert 0.9 <= time.monotonic() - started < 5
    assert "FIFO is full" in caplog.text
    client.close()


def test_client_reopens_after_the_supervisor_restarts(fifo: Path) -> None:
    create_fifo(fifo)
    fd = open_fifo(fifo)
    client = TimerClient(str(fifo))
    client.heartbeat()
    os.close(fd)  # the old reader is gone: the next write gets EPIPE
    create_fifo(fifo)
    fd = open_fifo(fifo)
    try:
        client.heartbeat()
        assert read_requests(fd)[0].scope == HEARTBEAT_SCOPE
    finally:
        os.close(fd)
        client.close()


# ------------------------------------------------------------------------ D state


def test_d_tracker_reports_after_timeout_once() -> None:
    tracker = DStateTracker(timeout=10)
    assert tracker.observe(0, {5: 100}) == []
    assert tracker.observe(9.9, {5: 100}) == []
    assert tracker.observe(10, {5: 100}) == [(5, 10)]
    assert tracker.observe(20, {5: 100}) == []  # once per episode


def test_d_tracker_restarts_when_the_process_leaves_d() -> None:
    tracker = DStateTracker(timeout=10)
    tracker.observe(0, {5: 100})
    tracker.observe(5, {})
    assert tracker.observe(12, {5: 100}) == []
    assert tracker.observe(22, {5: 100}) == [(5, 10)]


def test_d_tracker_ignores_a_process_that_keeps_running() -> None:
    tracker = DStateTracker(timeout=10)
    for t in range(0, 60, 5):  # in D at every sample, but it switched in between
        assert tracker.observe(t, {5: 100 + t}) == []


def test_d_tracker_new_episode_after_report_is_reported_again() -> None:
    tracker = DStateTracker(timeout=1)
    tracker.observe(0, {5: 1})
    assert tracker.observe(1, {5: 1}) == [(5, 1)]
    tracker.observe(2, {5: 2})  # it ran: a new episode
    assert tracker.observe(3, {5: 2}) == [(5, 1)]


def test_d_tracker_clear_and_several_pids() -> None:
    tracker = DStateTracker(timeout=1)
    tracker.observe(0, {3: 1, 4: 1})
    assert tracker.observe(1, {3: 1, 4: 1}) == [(3, 1), (4, 1)]
    tracker.clear()
    assert tracker.observe(1.5, {3: 1}) == []


async def test_d_monitor_reports_through_callback_with_attempt() -> None:
    events: list[WorkerUnhealthy] = []

    async def record(event: WorkerUnhealthy) -> None:
        events.append(event)

    monitor = DStateMonitor(
        lambda: {10: 2}, record, hang_state_timeout=0,
        sampler=lambda workers: {11: DSample(workers[10], 5)},
    )
    monitor.reset(4)
    await monitor.check_once()
    await monitor.check_once()
    [event] = events
    assert (event.attempt, event.local_rank, event.pid) == (4, 2, 11)
    assert "uninterruptible" in event.reason








async def first_d_report(workers: dict[int, int]) -> WorkerUnhealthy:
    """Run a monitor (attempt 1) until it reports; return the report."""
    send, receive = anyio.create_memory_object_stream[WorkerUnhealthy](4)
    monitor = DStateMonitor(lambda: workers, send.send, hang_state_timeout=0.3, interval=0.05)
    monitor.reset(1)
    with send, receive:
        async with anyio.create_task_group() as tg:
            await tg.start(monitor.run)
            with anyio.fail_after(WAIT):
                event = await receive.receive()
            tg.cancel_scope.cancel()
    return event


async def test_d_state_of_a_real_worker_is_reported(spawn: SpawnFn, freezer: Freezer) -> None:
    child = await spawn("ignore-term")
    freezer.freeze(child.pid)
    await wait_until(lambda: proc_state(child.pid) == "D")
    sampled = sample_d_state({child.pid: 0})
    assert set(sampled) == {child.pid}
    # the count psutil reads from the same /proc files: frozen, it does not move
    assert sampled[child.pid].switches == sum(psutil.Process(child.pid).num_ctx_switches())
    event = await first_d_report({child.pid: 3})
    assert (event.pid, event.local_rank, event.attempt) == (child.pid, 3, 1)


async def test_d_state_of_a_descendant_is_reported(spawn: SpawnFn, freezer: Freezer) -> None:
    child = await spawn("grandchild", "ignore-term")
    grandchild = int((await child.line()).split()[1])
    freezer.freeze(grandchild)
    await wait_until(lambda: proc_state(grandchild) == "D")
    event = await first_d_report({child.pid: 1})
    assert (event.pid, event.local_rank) == (grandchild, 1)
    assert proc_state(child.pid) != "D"


async def test_no_d_state_no_report(spawn: SpawnFn) -> None:
    child = await spawn("ignore-term")
    assert sample_d_state({child.pid: 0}) == {}
