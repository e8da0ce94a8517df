"""Files a worker can replace are opened without blocking and only if regular (issue 52,
finding 2): ``safepaths`` and each of its users (event log, rank logs, hang dump, the
``--preload auto`` list), with real FIFOs and device nodes, each open bounded in time."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from supervisor.events import EventLog
from supervisor.safepaths import open_below, open_in_dir, replace_file
from supervisor.watchdog.escalate import HangDump, ProcessHandle, dump_hang
from supervisor.workers.output import LogFile
from supervisor.workers.warm import autopreload

BOUND = 5.0  # seconds; an open that blocks on a FIFO never returns (the bug)


@pytest.fixture
def rank_dir(tmp_path: Path) -> Path:
    made = tmp_path / "logs" / "run" / "attempt_0" / "0"
    made.mkdir(parents=True, mode=0o755)
    return made


@contextlib.contextmanager
def reader(fifo: Path) -> Iterator[None]:
    """Someone holds the FIFO open for reading (a write-open then succeeds)."""
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        yield
    finally:
        os.close(fd)


def test_a_fifo_nobody_reads_is_refused_at_once(rank_dir: Path) -> None:
    os.mkfifo(rank_dir / "stdout.log")
    with pytest.raises(OSError, match="is a FIFO or a device, not a regular file"):
        open_below(rank_dir.parents[2], rank_dir / "stdout.log")


def test_a_fifo_with_a_reader_is_refused_after_the_open(rank_dir: Path) -> None:
    os.mkfifo(rank_dir / "stdout.log")
    with reader(rank_dir / "stdout.log"), pytest.raises(OSError, match="is a FIFO, not"):
        open_below(rank_dir.parents[2], rank_dir / "stdout.log")


def test_a_device_node_is_refused(rank_dir: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a device node (mknod)")
    os.mknod(rank_dir / "stdout.log", stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null
    with pytest.raises(OSError, match="is a character device, not a regular file"):
        open_below(rank_dir.parents[2], rank_dir / "stdout.log")


def test_a_regular_file_is_opened_blocking(rank_dir: Path) -> None:
    fd = open_below(rank_dir.parents[2], rank_dir / "stdout.log")
    try:
        assert os.get_blocking(fd) and stat.S_ISREG(os.fstat(fd).st_mode)
    finally:
        os.close(fd)


@pytest.mark.parametrize("mode", [0o775, 0o757])
def test_a_directory_writable_by_group_or_others_is_refused(rank_dir: Path,
                                                            mode: int) -> None:
    rank_dir.chmod(mode)
    with pytest.raises(PermissionError, match="is writable by"):
        open_below(rank_dir.parents[2], rank_dir / "stdout.log")
    assert not (rank_dir / "stdout.log").exists()


async def test_the_event_log_reopen_over_a_fifo_keeps_writing_the_old_file(
    tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    log = EventLog(run_dir / "events.jsonl", "run", root=tmp_path)
    log.emit("before")
    (run_dir / "events.jsonl").rename(run_dir / "events.jsonl.1")
    os.mkfifo(run_dir / "events.jsonl")
    with anyio.fail_after(BOUND):
        await log.reopen()
    log.emit("after")
    log.close()
    kept = (run_dir / "events.jsonl.1").read_text()
    assert '"event":"before"' in kept and '"event":"after"' in kept


async def test_a_rank_log_reopen_over_a_fifo_keeps_the_old_file(rank_dir: Path) -> None:
    log = LogFile(rank_dir / "stdout.log", root=rank_dir.parents[2])
    (rank_dir / "stdout.log").rename(rank_dir / "stdout.log.1")
    os.mkfifo(rank_dir / "stdout.log")
    with anyio.fail_after(BOUND):
        await log.reopen()
    log.write(b"still here\n")
    log.close()
    assert (rank_dir / "stdout.log.1").read_bytes() == b"still here\n"


def test_the_hang_dump_is_a_new_file_never_a_planted_one(rank_dir: Path,
                                                         tmp_path: Path) -> None:
    os.mkfifo(rank_dir / "hang-1.txt")
    with pytest.raises(FileExistsError):
        open_in_dir(rank_dir / "hang-1.txt")
    (rank_dir / "hang-2.txt").symlink_to(tmp_path / "target")
    with pytest.raises(FileExistsError):
        open_in_dir(rank_dir / "hang-2.txt")
    assert not (tmp_path / "target").exists()


def test_the_hang_dump_is_not_written_into_a_rank_dir_swapped_for_a_link(
    rank_dir: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    rank_dir.rename(rank_dir.with_name("moved"))
    rank_dir.symlink_to(elsewhere)
    with pytest.raises(OSError, match="symbolic link"):
        open_in_dir(rank_dir / "hang-1.txt")
    assert list(elsewhere.iterdir()) == []


async def test_a_py_spy_dump_over_a_planted_fifo_gives_up_at_once(
    rank_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The whole ``dump_hang``: py-spy is never run, one warning, nothing blocks."""
    pid = os.getpid()
    os.mkfifo(rank_dir / f"hang-{pid}.txt")
    handle = ProcessHandle.open(pid)
    assert handle is not None
    try:
        with anyio.fail_after(BOUND):
            await dump_hang(handle, HangDump("py-spy", py_spy="/bin/false"),
                            rank_dir / f"hang-{pid}.txt")
    finally:
        handle.close()
    assert f"py-spy dump of pid {pid} failed" in caplog.text and "File exists" in caplog.text
    assert (rank_dir / f"hang-{pid}.txt").is_fifo()


def test_the_preload_list_is_kept_over_planted_fifos(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o755)
    os.mkfifo(run_dir / f".{autopreload.KEPT_NAME}.{os.getpid()}")
    os.mkfifo(run_dir / autopreload.KEPT_NAME)
    autopreload.keep(run_dir, ["numpy", "json"], {"torch"})
    assert autopreload.read_kept(run_dir) == (["numpy", "json"], {"torch"})
    assert sorted(p.name for p in run_dir.iterdir()) == [autopreload.KEPT_NAME]


def test_replace_file_refuses_a_directory_writable_by_others(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by others"):
        replace_file(shared / "list.json", b"{}")
    assert list(shared.iterdir()) == []
