"""Regression tests for issue 18 (security review and fault injection): files a worker can
reach, attempt directories, the health server's connection cap and response sizes."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from supervisor.workers.attemptdir import MAX_SKIPPED, create_attempt_dir
from supervisor.workers.errorfile import read_error_file
from tests.conftest import supervisor
from tests.tmpfs import small_tmpfs


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


SYMLINKED_ERROR_FILE = """
import json, os, sys
secret = sys.argv[1]
with open(secret, "w") as f:
    json.dump({"message": {"message": "RuntimeError: planted-secret-text",
                           "extraInfo": {"py_callstack": "", "timestamp": "0"}}}, f)
path = os.environ["TORCHELASTIC_ERROR_FILE"]
if sys.argv[2] == "symlink":
    os.symlink(secret, path)
else:
    os.replace(secret, path)
sys.exit(3)
"""


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

