"""``elastic-supervisor status`` without ``--url`` finds the supervisors on this host
through the ``health.json`` each writes into its runtime directory (supervisor.discovery)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from supervisor.discovery import ANNOUNCE, announce, find_supervisors, local_url
from tests.support.daemon import supervisor
from tests.support.paths import FAKE_WORKER


def test_an_announcement_is_found_while_its_process_lives(tmp_path: Path) -> None:
    announce(tmp_path, "http://127.0.0.1:4242", "job-a")
    (found,) = find_supervisors([tmp_path])
    assert (found.pid, found.url, found.run_id) == (os.getpid(), "http://127.0.0.1:4242", "job-a")
    assert (tmp_path / ANNOUNCE).stat().st_mode & 0o777 == 0o600


def test_a_dead_supervisors_announcement_is_ignored(tmp_path: Path) -> None:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    (tmp_path / ANNOUNCE).write_text(
        f'{{"pid": {child.stdout.strip()}, "url": "http://127.0.0.1:1", "run_id": "x"}}')
    assert find_supervisors([tmp_path]) == []


@pytest.mark.parametrize("body", ["not json", "[]", '{"pid": "1", "url": "http://a:1"}',
                                  '{"pid": 1, "url": "file:///etc/passwd"}',
                                  '{"pid": 1, "url": "http://a"}'])
def test_an_odd_announcement_is_ignored(tmp_path: Path, body: str) -> None:
    (tmp_path / ANNOUNCE).write_text(body)
    assert find_supervisors([tmp_path]) == []


def test_a_symlinked_announcement_is_not_followed(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    announce(real, "http://127.0.0.1:4242", "job-a")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / ANNOUNCE).symlink_to(real / ANNOUNCE)
    assert [f.where for f in find_supervisors([real, linked])] == [str(real)]


def test_wildcard_hosts_are_reached_on_loopback() -> None:
    assert local_url("0.0.0.0", 80) == "http://127.0.0.1:80"
    assert local_url("::", 80) == "http://[::1]:80"
    assert local_url("10.1.2.3", 80) == "http://10.1.2.3:80"


def status(tmp: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor", "status"],
                          env={**os.environ, "TMPDIR": str(tmp)}, capture_output=True,
                          text=True, timeout=30)


async def test_status_shows_the_one_supervisor_here_or_lists_several(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()  # the supervisors' runtime dirs, away from other tests' supervisors
    env = {"TMPDIR": str(tmp)}

    def args(run_id: str) -> list[str]:
        return ["--health-port=0", f"--rdzv-id={run_id}", f"--log-dir={tmp_path}",
                FAKE_WORKER, "--hang"]

    async with supervisor(args("first"), env=env) as first:
        await first.out.expect("ready 0", timeout=30)
        await first.err.expect("health endpoint on", timeout=30)
        one = await anyio.to_thread.run_sync(status, tmp)
        async with supervisor(args("second"), env=env) as second:
            await second.out.expect("ready 0", timeout=30)
            await second.err.expect("health endpoint on", timeout=30)
            several = await anyio.to_thread.run_sync(status, tmp)
    assert one.returncode == 0 and "run         first" in one.stdout, one.stderr
    assert several.returncode == 2
    assert "2 supervisors run on this host" in several.stderr
    assert "run first" in several.stderr and "run second" in several.stderr
