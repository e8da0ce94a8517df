"""A full log disk is the supervisor's failure, not the workers' (issue 18 item 8).

The log directory is a real tmpfs with few inodes: once they are used up, the next
attempt's directory cannot be made. That must not count as a worker failure, must not
spin through the restart budget, and must resume once space returns.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.daemon import supervisor
from tests.support.paths import FAKE_WORKER

BASE = ["--health-port", "0", "--shutdown-timeout", "5"]


@contextlib.contextmanager
def tiny_tmpfs(path: Path, inodes: int) -> Iterator[Path]:
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=4m,nr_inodes={inodes}",
                           "tmpfs", str(path)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill_inodes(directory: Path) -> list[Path]:
    """Create empty files until the file system has no inode left."""
    made = []
    with contextlib.suppress(OSError):
        while True:
            path = directory / uuid.uuid4().hex
            path.touch()
            made.append(path)
    return made


async def test_full_log_disk_retries_without_the_budget_and_resumes(tmp_path: Path) -> None:
    with tiny_tmpfs(tmp_path / "disk", inodes=64) as disk:
        events = tmp_path / "events.jsonl"  # on another disk: the test reads it
        args = [*BASE, "--max-restarts", "1", "--log-dir", str(disk), "--event-log",
                str(events), FAKE_WORKER, "--hang", "--usr1-exit", "1", "--fail-attempts", "1"]
        async with supervisor(args) as sup:
            pid = int((await sup.out.expect(r"^ready 0 (\d+) 0$")).group(1))
            filler = disk / "filler"
            filler.mkdir()
            made = fill_inodes(filler)
            os.kill(pid, signal.SIGUSR1)  # the one real failure: exit 1
            await sup.err.expect(r"cannot prepare .*attempt_1.*no restart is used")
            await sup.err.expect(r"preparing the attempt again: retry 1/10 in 1 s")
            for path in made:  # space returns
                path.unlink()
            await sup.out.expect(r"^ready 0 \d+ 1$", timeout=20)
            sup.signal(signal.SIGTERM)
            assert await sup.wait() == 128 + signal.SIGTERM
    records = [json.loads(line) for line in events.read_text().splitlines()]
    kinds = [r["event"] for r in records]
    assert kinds.count("restart_scheduled") == 1  # the worker's failure, and only that
    assert "attempt_prepare_failed" in kinds and "prepare_retry_scheduled" in kinds
    exits = [r for r in records if r["event"] == "worker_exited"]
    assert [r["exit_code"] for r in exits[:1]] == [1]  # no "127" for ranks never started
    assert all(r.get("exit_code") != 127 for r in exits)
