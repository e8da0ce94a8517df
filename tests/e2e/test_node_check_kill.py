"""Node checks obey the kill and no-orphan rules of workers (issue 52, finding 3).

A check stuck in uninterruptible sleep (a frozen cgroup, as ``nvidia-smi`` on a GPU that
fell off the bus) hung the supervisor past its timeout and made it deaf to SIGTERM; a check
that exited while a ``setsid`` helper held its stdout was reaped at once, so its timeout's
``killpg`` hit whatever group had that number by then; with no death signal, a check
outlived a ``kill -9`` of the supervisor. Each is reproduced here with real processes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from supervisor.workers import nodecheck
from supervisor.workers.nodecheck import KILL_WAIT, NodeChecker
from tests.support.daemon import supervisor
from tests.support.paths import FAKE_WORKER, REPO, TESTS, WORKERS
from tests.support.processes import pid_alive, wait_dead
from tests.support.watchdog import Freezer, proc_state

CHECK = str(TESTS / "workers" / "node_check.py")
STEERING = str(WORKERS / "check_pid_steering.py")
SWEEP = str(WORKERS / "check_during_sweep.py")
GRACE = 5


async def pids_in(pidfile: Path, timeout: float = 20.0) -> list[int]:
    """The pids a check wrote (it replaces the file whole); waits for the file's entry."""
    with anyio.fail_after(timeout):
        while not pidfile.exists():
            await anyio.sleep(0.02)  # another process writes it: no event to wait on
    return [int(p) for p in pidfile.read_text().split()]


def check_command(*args: str) -> str:
    return " ".join([sys.executable, CHECK, *args])


async def test_a_check_stuck_in_d_state_fails_and_is_abandoned(
    tmp_path: Path, freezer: Freezer
) -> None:
    pidfile = tmp_path / "pids"
    checker = NodeChecker([sys.executable, CHECK, "--hang", str(pidfile)], dict(os.environ),
                          2.0, tmp_path / "logs")
    async with anyio.create_task_group() as tg:
        results = []

        async def run() -> None:
            results.append(await checker.run())

        started = time.monotonic()
        tg.start_soon(run)
        leader, grandchild = await pids_in(pidfile)
        freezer.freeze(leader)
    took = time.monotonic() - started
    [result] = results
    assert not result.ok and result.timed_out
    assert "did not die within 5 s of SIGKILL" in result.reason and "abandoned" in result.reason
    assert took < 2.0 + KILL_WAIT + 5.0
    assert proc_state(leader) == "D" and leader in nodecheck.running_pids()
    await wait_dead([grandchild], timeout=5)  # its group was killed
    freezer.release()  # thawed; the group itself is removed by the fixture, once reaped
    await wait_dead([leader], timeout=10)  # a zombie of ours now: reaped by the next check
    assert (await NodeChecker([], {}, 5.0, tmp_path / "logs").run()).ok
    passing = await NodeChecker([sys.executable, CHECK], dict(os.environ), 30.0,
                                tmp_path / "logs").run()
    assert passing.ok
    assert not os.path.exists(f"/proc/{leader}") and leader not in nodecheck.running_pids()


async def test_sigterm_stops_the_daemon_while_its_check_is_stuck_in_d_state(
    tmp_path: Path, freezer: Freezer
) -> None:
    pidfile = tmp_path / "pids"
    args = ["--node-check", check_command("--hang", str(pidfile)), "--node-check-timeout",
            "60", "--shutdown-timeout", str(GRACE), "--log-dir", str(tmp_path / "logs"),
            "--no-health", FAKE_WORKER]
    async with supervisor(args) as sup:
        leader, grandchild = await pids_in(pidfile)
        freezer.freeze(leader)
        started = time.monotonic()
        sup.signal(signal.SIGTERM)
        code = await sup.wait(timeout=GRACE + KILL_WAIT + 20)
        took = time.monotonic() - started
    assert code == 128 + signal.SIGTERM, sup.err.text()
    assert took < GRACE + KILL_WAIT + 10
    assert f"node check pid {leader} did not die within 5 s of SIGKILL" in sup.err.text()
    await wait_dead([grandchild], timeout=5)
    freezer.release()  # thawed; the group itself is removed by the fixture, once reaped
    await wait_dead([leader], timeout=10)


async def test_kill_9_of_the_supervisor_during_a_check_leaves_nothing(tmp_path: Path) -> None:
    pidfile, helperfile = tmp_path / "pids", tmp_path / "helper"
    args = ["--node-check", check_command("--setsid-helper", str(helperfile), "--hang",
                                          str(pidfile)),
            "--node-check-timeout", "60", "--log-dir", str(tmp_path / "logs"), "--no-health",
            FAKE_WORKER]
    async with supervisor(args) as sup:
        leader, grandchild = await pids_in(pidfile)
        _, helper = await pids_in(helperfile)
        assert all(pid_alive(p) for p in (leader, grandchild, helper))
        sup.signal(signal.SIGKILL)
        await sup.wait()
    # the leader by its death signal, its group and the helper (the cookie) by the guardian
    await wait_dead([leader, grandchild, helper], timeout=10)


def test_a_pid_steered_to_another_group_after_the_check_is_untouched(tmp_path: Path) -> None:
    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare or "unshare", "--pid", "--fork", "--mount-proc", "true"],
                           capture_output=True, check=False) if unshare else None
    if probe is None or probe.returncode != 0:
        pytest.skip("needs unshare --pid --fork --mount-proc (util-linux, root) for a pid "
                    "namespace whose ns_last_pid the test can steer")
    timeout = 20.0
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [unshare, "--pid", "--fork", "--mount-proc", sys.executable, STEERING, CHECK,
         str(tmp_path / "pids"), str(timeout)],
        capture_output=True, text=True, timeout=90, check=False, env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["ok"], report
    assert report["seconds"] < timeout / 2  # its result at its exit, not at the timeout
    assert report["decoy_steered"], "the decoy never got the leader's pid"
    assert report["decoy_alive"], "the decoy that took the check's pid was killed"
    assert not report["helper_alive"], "the setsid helper the check left outlived it"


def test_a_group_stop_leaves_a_running_check_alone(tmp_path: Path) -> None:
    """A group's sweep of adopted children once killed a periodic check (then taken for a
    signal from outside); the check is exempt like the guardian and the standbys."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, SWEEP, CHECK, str(tmp_path)], capture_output=True,
                            text=True, timeout=90, check=False, env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"leader_alive": True, "grandchild_alive": True}
