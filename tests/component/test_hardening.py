"""Regression tests for issue 18 (security review and fault injection): files a worker can
reach, attempt directories, the health server's connection cap and response sizes."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import errno
import json
import os
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import aiohttp
import anyio
import anyio.abc
import pytest
from msgspec.structs import replace

from supervisor.core.statusview import MAX_MESSAGE_CHARS, FailureView, cap_text
from supervisor.health.connections import ConnectionLedger
from supervisor.health.server import MAX_CONNECTIONS, load_openapi
from supervisor.workers.attemptdir import MAX_SKIPPED, create_attempt_dir
from supervisor.workers.errorfile import read_error_file
from tests.support.daemon import supervisor
from tests.support.health import Harness, make_status_view, running_server
from tests.support.paths import FAKE_WORKER, WORKERS
from tests.support.tmpfs import small_tmpfs


def torch_error(message: str) -> str:
    return json.dumps({"message": {"message": f"RuntimeError: {message}",
                                   "extraInfo": {"py_callstack": "", "timestamp": "0"}}})


# --------------------------------------------------------------------- error files


def test_error_file_symlinked_to_another_json_file_is_not_read(tmp_path: Path) -> None:
    """Item 7: error.json -> another JSON file must not show that file's text."""
    secret = tmp_path / "secret.json"
    secret.write_text(torch_error("the secret text"))
    link = tmp_path / "error.json"
    link.symlink_to(secret)
    assert read_error_file(secret) is not None  # the target itself is a valid report
    assert read_error_file(link) is None


def test_error_file_in_a_regular_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    path.write_text(torch_error("boom"))
    report = read_error_file(path)
    assert report is not None and report.summary == "RuntimeError: boom"


IN_OPEN = 0x20
IN_NONBLOCK = os.O_NONBLOCK


@contextlib.contextmanager
def opens_of(path: Path) -> Iterator[Callable[[], int]]:
    """Watch ``path`` with inotify; the function yielded says how many opens it saw since."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(IN_NONBLOCK | os.O_CLOEXEC)
    if fd < 0:
        pytest.skip("inotify is not available")

    def count() -> int:
        seen = 0
        try:
            while data := os.read(fd, 4096):
                seen += len(data) // 16  # struct inotify_event without a name
        except BlockingIOError:
            pass
        return seen

    try:
        if libc.inotify_add_watch(fd, str(path).encode(), IN_OPEN) < 0:
            pytest.skip("inotify cannot watch this file system")
        yield count
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_error_file_that_is_not_regular_is_never_opened(tmp_path: Path, kind: str) -> None:
    """Item 7: a FIFO or device at the path is refused by lstat, before any open()."""
    path = tmp_path / "error.json"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # like /dev/null
        except PermissionError:
            pytest.skip("mknod needs CAP_MKNOD (run the tests as root)")
    with opens_of(path) as opens:
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))  # the watch sees an open
        assert opens() == 1
        assert read_error_file(path) is None
        assert opens() == 0


SYMLINKED_ERROR_FILE = (WORKERS / "symlinked_error_file.py").read_text()


@pytest.mark.parametrize("kind", ["symlink", "regular"])
async def test_symlinked_error_file_is_not_the_failure_message(tmp_path: Path, kind: str) -> None:
    """Through the real daemon: the root cause never shows a symlink target's text; the
    regular-file case shows it (so the check can fail)."""
    script = tmp_path / "plant.py"
    script.write_text(SYMLINKED_ERROR_FILE)
    log_dir = tmp_path / "logs"
    args = ["--health-port", "0", "--max-restarts", "0", "--log-dir", str(log_dir),
            "--rdzv-id", "plant", str(script), str(tmp_path / "secret.json"), kind]
    async with supervisor(args) as sup:
        assert await sup.wait() == 3
    events = (log_dir / "plant" / "events.jsonl").read_text()
    shown = "planted-secret-text" in sup.err.text() or "planted-secret-text" in events
    assert shown == (kind == "regular"), sup.err.text()


# --------------------------------------------------------------- attempt directories


def test_attempt_dir_is_created_with_its_rank_dirs(tmp_path: Path) -> None:
    run_dir = tmp_path / "logs" / "run"
    created = create_attempt_dir(run_dir, 0, 3)
    assert (created.index, created.path) == (0, run_dir / "attempt_0")
    assert sorted(p.name for p in created.path.iterdir()) == ["0", "1", "2"]
    assert created.rank_dir(2) == run_dir / "attempt_0" / "2"


def test_attempt_dir_that_exists_is_skipped_and_left_alone(tmp_path: Path) -> None:
    """Item 7: a worker that planted attempt_1/0/error.json cannot feed it to attempt 1."""
    run_dir = tmp_path / "run"
    planted = run_dir / "attempt_1" / "0"
    planted.mkdir(parents=True)
    (planted / "error.json").write_text(torch_error("planted"))
    created = create_attempt_dir(run_dir, 1, 1)
    assert created.index == 2
    assert not (created.rank_dir(0) / "error.json").exists()
    assert (planted / "error.json").read_text() == torch_error("planted")


def test_attempt_dir_planted_as_a_symlink_is_skipped(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_dir.mkdir()
    (run_dir / "attempt_0").symlink_to(elsewhere)
    created = create_attempt_dir(run_dir, 0, 1)
    assert created.index == 1 and not created.path.is_symlink()
    assert list(elsewhere.iterdir()) == []


def test_attempt_dir_gives_up_after_max_skipped(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    for k in range(MAX_SKIPPED + 1):
        (run_dir / f"attempt_{k}").mkdir(parents=True)
    with pytest.raises(FileExistsError):
        create_attempt_dir(run_dir, 0, 1)


def test_attempt_dir_out_of_inodes_raises_and_leaves_nothing_half_made(tmp_path: Path) -> None:
    """No inode for the second rank dir: ENOSPC is raised (the caller reports it as a
    supervisor-side failure) and the half-made attempt_0 is gone, so a retry reuses 0."""
    # inodes: the mount's root, run, attempt_0, one rank dir
    with small_tmpfs(tmp_path / "disk", inodes=4) as root:
        run_dir = root / "run"
        with pytest.raises(OSError) as raised:
            create_attempt_dir(run_dir, 0, 2)
        assert raised.value.errno == errno.ENOSPC
        assert list(run_dir.iterdir()) == []
        assert create_attempt_dir(run_dir, 0, 1).index == 0


def test_attempt_dir_rejects_a_negative_index(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        create_attempt_dir(tmp_path, -1, 1)



# ------------------------------------------------------------------ health server


def test_ledger_evicts_the_oldest_waiting_connection() -> None:
    ledger = ConnectionLedger(2)
    a, b, c = object(), object(), object()
    ta, tb, tc = (cast(asyncio.BaseTransport, name) for name in ("ta", "tb", "tc"))
    assert ledger.opened(a, ta) is None
    assert ledger.opened(b, tb) is None
    assert ledger.opened(c, tc) is ta and ledger.evicted == 1
    ledger.closed(a)  # the server's callback after the close
    assert len(ledger) == 2


def test_ledger_never_evicts_a_busy_connection() -> None:
    ledger = ConnectionLedger(2)
    a, b, c = object(), object(), object()
    ledger.opened(a, cast(asyncio.BaseTransport, "ta"))
    ledger.opened(b, cast(asyncio.BaseTransport, "tb"))
    ledger.request_started(a)
    ledger.request_started(b)
    assert ledger.opened(c, cast(asyncio.BaseTransport, "tc")) == "tc"  # the newcomer
    assert ledger.evicted == 0


def test_ledger_orders_by_time_waiting_since_the_last_response() -> None:
    ledger = ConnectionLedger(2)
    a, b, c = object(), object(), object()
    ledger.opened(a, cast(asyncio.BaseTransport, "ta"))
    ledger.opened(b, cast(asyncio.BaseTransport, "tb"))
    ledger.request_started(a)
    ledger.request_done(a)  # a answered: it now waits since later than b
    assert ledger.opened(c, cast(asyncio.BaseTransport, "tc")) == "tb"


async def probe(port: int) -> int:
    async with (aiohttp.ClientSession() as client,
                client.get(f"http://127.0.0.1:{port}/healthz") as resp):
        return resp.status


async def test_idle_connections_over_the_cap_do_not_lock_probes_out() -> None:
    """Item 3: 70+ idle TCP connections; /healthz still answers 200 at once, and the oldest
    idle connections are the ones closed."""
    h = Harness()
    with anyio.fail_after(20):
        async with running_server(h) as (_, port):
            idle = [await anyio.connect_tcp("127.0.0.1", port) for _ in range(MAX_CONNECTIONS + 8)]
            half = await anyio.connect_tcp("127.0.0.1", port)
            await half.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never finished
            with anyio.fail_after(2):  # "at once": far below the 10 s request deadline
                assert await probe(port) == 200
            for stream in idle[:9]:  # the nine oldest made room for the eight, then the probe
                with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                    await stream.receive()
            assert b"http_connections_evicted_total 10.0" in h.metrics.render()
            for stream in [*idle, half]:
                await stream.aclose()


async def test_a_client_reconnecting_idle_connections_cannot_lock_probes_out() -> None:
    """Item 3: a client that keeps reopening idle connections as fast as it can; every
    probe in between is answered."""
    h = Harness()
    with anyio.fail_after(60):
        async with running_server(h) as (_, port), anyio.create_task_group() as tg:
            stop = anyio.Event()
            opened = 0

            async def flood() -> None:
                nonlocal opened
                held: collections.deque[anyio.abc.SocketStream] = collections.deque()
                while not stop.is_set():
                    held.append(await anyio.connect_tcp("127.0.0.1", port))
                    opened += 1
                    if len(held) > 2 * MAX_CONNECTIONS:  # the client's own fd budget
                        await held.popleft().aclose()
                for stream in held:
                    await stream.aclose()

            tg.start_soon(flood)
            codes = []
            while len(codes) < 20 or opened < 4 * MAX_CONNECTIONS:
                codes.append(await probe(port))
            stop.set()
        assert codes == [200] * len(codes)


async def test_status_with_a_huge_failure_message_stays_small() -> None:
    """Item 3: a 1 MiB error-file message was repeated twice in /status (2 MB)."""
    huge = "RuntimeError: " + "x" * (1 << 20)
    failure = FailureView(
        kind="exited", attempt=1, local_rank=0, global_rank=0, pid=4000, exit_code=1,
        signal=None, message=huge, description=f"local rank 0 exited with code 1: {huge}",
        at_wall=time.time(),
    )
    h = Harness(snapshot=replace(make_status_view("failed"), last_failure=failure))
    with anyio.fail_after(10):
        async with running_server(h) as (client, _), client.get("/status") as resp:
            body = await resp.read()
    doc = json.loads(body)
    assert len(body) < 4 * MAX_MESSAGE_CHARS
    assert doc["last_failure"]["message"].startswith("RuntimeError: xxx")
    assert doc["last_failure"]["message"].endswith("more characters cut]")
    assert len(doc["last_failure"]["description"]) <= MAX_MESSAGE_CHARS


def test_cap_text_keeps_short_text_and_marks_what_it_cut() -> None:
    assert cap_text("short", 64) == "short"
    capped = cap_text("y" * 1000, 100)
    assert len(capped) <= 100 and capped.endswith("[964 more characters cut]")


@pytest.mark.xdist_group("load")  # a timing bound: not beside another test's load
async def test_daemon_answers_healthz_with_70_idle_connections_open(tmp_path: Path) -> None:
    """Item 3 through the real daemon: 70 idle connections, then /healthz is 200 at once."""
    args = ["--health-port", "0", "--health-host", "127.0.0.1", "--log-dir", str(tmp_path),
            FAKE_WORKER, "--hang"]
    async with supervisor(args) as sup:
        port = await sup.health_port()
        await sup.out.expect(r"^ready 0 ")
        with anyio.fail_after(10):
            while True:  # served once the first group launched (or 0.5 s passed)
                try:
                    if await probe(port) == 200:
                        break
                except aiohttp.ClientError:
                    await anyio.sleep(0.05)  # pacing: the server starts after the launch
        idle = [await anyio.connect_tcp("127.0.0.1", port) for _ in range(70)]
        try:
            with anyio.fail_after(2):
                assert await probe(port) == 200
        finally:
            for stream in idle:
                await stream.aclose()


def test_openapi_documents_the_message_cap() -> None:
    failure = json.loads(load_openapi())["components"]["schemas"]["Failure"]["properties"]
    assert failure["message"]["maxLength"] == MAX_MESSAGE_CHARS
    assert failure["description"]["maxLength"] == MAX_MESSAGE_CHARS
