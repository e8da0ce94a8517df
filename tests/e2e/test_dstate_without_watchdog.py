"""The D-state check is a health signal of its own: it runs with the deadline FIFO off
(``--no-watchdog``, ``TORCHELASTIC_ENABLE_FILE_TIMER=0``), where it used to stop too."""

from __future__ import annotations

import errno
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.daemon import supervisor
from tests.support.paths import FAKE_WORKER


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
        """Thaw, move the processes out and remove the group. A worker that exited is
        a zombie until its supervisor reaps it, and keeps the group busy (EBUSY) until
        then: the group is removed later, ``wait`` seconds at most (after the supervisor
        exited)."""
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
                    return  # removed at teardown
            time.sleep(0.05)  # nothing announces that the zombie was released


@pytest.fixture
def freezer() -> Iterator[Freezer]:
    root = Path("/sys/fs/cgroup/freezer")
    if not (root / "cgroup.procs").is_file() or not os.access(root, os.W_OK):
        pytest.skip("needs a writable cgroup v1 freezer at /sys/fs/cgroup/freezer (root) to "
                    "put a process in D state")
    made = Freezer(root)
    yield made
    made.release(wait=10.0)


@pytest.mark.parametrize("off", [["--no-watchdog"], ["TORCHELASTIC_ENABLE_FILE_TIMER=0"]],
                         ids=["no-watchdog", "file-timer-disabled"])
async def test_a_worker_in_d_state_fails_the_node_without_the_fifo(
        tmp_path: Path, freezer: Freezer, off: list[str]) -> None:
    flags = [a for a in off if a.startswith("--")]
    env = dict(a.split("=", 1) for a in off if "=" in a)
    args = ["--nproc-per-node", "1", "--no-health", "--hang-state-timeout", "0.5",
            "--shutdown-timeout", "2", "--log-dir", str(tmp_path / "logs"), *flags,
            FAKE_WORKER, "--hang"]
    async with supervisor(args, env=env) as sup:
        pid = int((await sup.out.expect(r"^ready 0 (\d+)")).group(1))
        assert "deadline FIFO at" not in sup.err.text()  # the FIFO is really off
        freezer.freeze(pid)
        await sup.err.expect(r"uninterruptible sleep \(D\)", timeout=30)
        freezer.release()  # a frozen process cannot die: let the stop finish
        assert await sup.wait() != 0
