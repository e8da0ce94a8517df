"""Log files below a shared ``--log-dir`` are never opened through a symlink.

Regression (issue 25, finding 6): as ``nobody``, a symlink at ``pub/JOB/events.jsonl`` to a
root-only file made root's supervisor append the job's events to it. Now the run directory
must be the supervisor user's and not writable by others (exit 2 in one line at start, as
for any unusable log directory), every path below the log directory is walked without
following a symlink, and a log file swapped for a symlink while the job runs is not
reopened through it (SIGHUP). ``--log-dir`` itself may be a symlink an administrator made.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.safepaths import open_below, prepare_run_dir
from supervisor.workers.attemptdir import create_attempt_dir
from supervisor.workers.output import LogFile
from tests.support.daemon import supervisor
from tests.support.paths import FAKE_WORKER

NOBODY = 65534
BASE = ["--health-port", "0", "--shutdown-timeout", "5", "--rdzv-id", "jobX"]


def _secret(tmp_path: Path) -> Path:
    secret = tmp_path / "secret"
    secret.write_text("root only\n")
    secret.chmod(0o600)
    return secret


def _run(log_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor", "run", *BASE, "--log-dir", str(log_dir),
         FAKE_WORKER, "--exit", "0"], capture_output=True, text=True, timeout=60, check=False)


def _one_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "Traceback" not in lines[0]
    return lines[0]


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """A world-writable sticky log directory, as /tmp or a shared volume."""
    pub = tmp_path / "pub"
    pub.mkdir()
    pub.chmod(0o1777)
    return pub


def test_a_run_directory_another_user_made_is_refused(shared: Path, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory owned by nobody")
    secret = _secret(tmp_path)
    planted = shared / "jobX"
    planted.mkdir()
    (planted / "events.jsonl").symlink_to(secret)
    os.lchown(planted / "events.jsonl", NOBODY, NOBODY)
    os.chown(planted, NOBODY, NOBODY)
    line = _one_line(_run(shared))
    assert "log_dir: unsafe run directory" in line and f"belongs to uid {NOBODY}" in line
    assert secret.read_text() == "root only\n"


def test_a_run_directory_that_is_a_symlink_is_refused(shared: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (shared / "jobX").symlink_to(target)
    line = _one_line(_run(shared))
    assert "is a symbolic link" in line
    assert list(target.iterdir()) == []


def test_a_run_directory_writable_by_others_is_refused(shared: Path) -> None:
    (shared / "jobX").mkdir(mode=0o777)
    (shared / "jobX").chmod(0o777)
    assert "is writable by others" in _one_line(_run(shared))


def test_a_symlinked_event_log_is_refused_at_start(shared: Path, tmp_path: Path) -> None:
    secret = _secret(tmp_path)
    (shared / "jobX").mkdir(mode=0o755)
    (shared / "jobX" / "events.jsonl").symlink_to(secret)
    line = _one_line(_run(shared))
    assert "cannot open the event log" in line and "symbolic link" in line
    assert secret.read_text() == "root only\n"


def test_the_log_dir_itself_may_be_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    result = _run(tmp_path / "link")
    assert result.returncode == 0, result.stderr
    assert (real / "jobX" / "events.jsonl").is_file()


def test_nothing_below_the_root_is_followed(tmp_path: Path) -> None:
    root = tmp_path / "logs"
    (root / "run" / "attempt_0" / "0").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "run" / "attempt_0" / "1").symlink_to(elsewhere)
    with pytest.raises(OSError) as caught:
        LogFile(root / "run" / "attempt_0" / "1" / "stdout.log", root=root)
    assert caught.value.errno == errno.ELOOP
    (root / "run" / "attempt_0" / "0" / "stdout.log").symlink_to(tmp_path / "target")
    with pytest.raises(OSError):
        open_below(root, root / "run" / "attempt_0" / "0" / "stdout.log")
    assert list(elsewhere.iterdir()) == [] and not (tmp_path / "target").exists()


def test_a_run_directory_swapped_for_a_symlink_fails_the_attempt_preparation(
    tmp_path: Path
) -> None:
    root = tmp_path / "logs"
    root.mkdir()
    prepare_run_dir(root, "run")
    assert create_attempt_dir(root / "run", 0, 1, root=root).index == 0
    (root / "run").rename(root / "moved")
    (root / "run").symlink_to(root / "moved")
    with pytest.raises(OSError) as caught:  # the attempt-directory rule: retried, then 73
        create_attempt_dir(root / "run", 1, 1, root=root)
    assert caught.value.errno == errno.ELOOP
    assert not (root / "moved" / "attempt_1").exists()


async def test_a_log_file_swapped_for_a_symlink_is_not_reopened_through_it(
    tmp_path: Path
) -> None:
    secret = _secret(tmp_path)
    args = [*BASE, "--tee", "3", "--log-dir", str(tmp_path / "logs"), FAKE_WORKER, "--trap",
            "1"]
    log = tmp_path / "logs" / "jobX" / "attempt_0" / "0" / "stdout.log"
    async with supervisor(args) as sup:
        await sup.out.expect(r"^\[default0\]:ready 0 ")
        log.rename(log.with_name("stdout.log.1"))
        log.symlink_to(secret)  # what a worker of the same user could do
        sup.signal(signal.SIGHUP)
        await sup.err.expect(r"cannot reopen .*stdout.log: .*symbolic link")
        sup.signal(signal.SIGUSR1)
        await sup.out.expect(r"^\[default0\]:got SIGUSR1 0$")
        sup.signal(signal.SIGTERM)
        assert await sup.wait() == 128 + signal.SIGTERM
    assert secret.read_text() == "root only\n"
    assert log.with_name("stdout.log.1").read_text().splitlines()[1:] == ["got SIGUSR1 0"]
