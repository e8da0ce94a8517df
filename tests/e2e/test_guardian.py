"""The guardian (issue 18, items 2, 5, 6 and 11): its cookie stays private, it kills only
processes of our uid, it forgets every pid we reap (even one reaped by a later sweep), a
stopped guardian cannot freeze the supervisor, and it removes a SIGKILLed supervisor's
runtime directory. Real processes throughout: the guardian, workers, a foreign user's
process, a cgroup freezer for a worker that survives SIGKILL."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import anyio
import psutil
import pytest

from supervisor.workers import stop
from supervisor.workers.guardian import COOKIE_ENV, Guardian, start_time
from supervisor.workers.spawn import (
    DeathSignal,
    Worker,
    WorkerSpec,
    on_reaping,
    spawn_worker,
    wait_exit,
)
from tests.support.daemon import Supervised, supervisor
from tests.support.paths import FAKE_WORKER
from tests.support.processes import pid_alive, wait_dead
from tests.support.watchdog import Freezer, proc_state

WAIT = 20.0
NOBODY = 65534


def guardian_pid(sup_pid: int, workers: list[int]) -> int:
    """The supervisor's one child that is not a worker (no standbys: --no-warm-restart)."""
    found = [c.pid for c in psutil.Process(sup_pid).children() if c.pid not in workers]
    assert len(found) == 1, found
    return found[0]


# ------------------------------------------------------------------ item 5: the cookie


def test_cookie_is_not_on_the_guardians_command_line() -> None:
    """Regression: the cookie was the guardian's argv[2], readable by every user."""
    cookie = "c0ffee" * 5
    guardian = Guardian(cookie)
    try:
        with open(f"/proc/{guardian.pid}/cmdline", "rb") as f:
            cmdline = f.read()
        assert cookie.encode() not in cmdline
        assert guardian._proc.poll() is None, "the guardian exited at once"
        environ = exec_environ(guardian.pid)
        assert f"ELASTIC_SUPERVISOR_GUARDIAN_MARK={COOKIE_ENV}={cookie}".encode() in environ
        assert stat_mode(f"/proc/{guardian.pid}/environ") == 0o400  # private to its uid
    finally:
        guardian.close()


def exec_environ(pid: int, timeout: float = 10.0) -> list[bytes]:
    """The environment of ``pid`` once its exec is complete. Popen returns when the exec
    passed its point of no return (the CLOEXEC pipe closed), which is before the kernel
    has laid the new environment out: until then ``/proc/PID/environ`` reads empty."""
    deadline = time.monotonic() + timeout
    while True:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
        if data or time.monotonic() > deadline:
            return data.split(b"\0")
        os.sched_yield()


def stat_mode(path: str) -> int:
    return os.stat(path).st_mode & 0o777


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start a process as another user")
async def test_cookie_carrier_of_another_uid_is_not_killed() -> None:
    """Regression: a root guardian SIGKILLed any process whose environment carried the
    cookie, even another user's, at a normal exit. Ours (same uid) is still killed."""
    setpriv = "/usr/bin/setpriv"
    if not os.access(setpriv, os.X_OK):
        pytest.skip("needs util-linux setpriv (apt-get install util-linux)")
    cookie = "feed" * 8
    env = {"PATH": "/usr/bin:/bin", COOKIE_ENV: cookie}
    foreign = subprocess.Popen(
        [setpriv, "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups", "--",
         "sleep", "600"], env=env)
    ours = subprocess.Popen(["sleep", "600"], env=env)
    try:
        with anyio.fail_after(WAIT):  # both carry the cookie, the foreign one as nobody
            while not (all(_carries(p.pid, cookie) for p in (foreign, ours))
                       and psutil.Process(foreign.pid).uids().real == NOBODY):
                await anyio.sleep(0.01)  # nothing to wait on: exec is not an event we see
        guardian = Guardian(cookie)
        guardian.close()  # EOF: the guardian sweeps as if we had died
        assert ours.wait(WAIT) == -signal.SIGKILL
        assert foreign.poll() is None and pid_alive(foreign.pid)
    finally:
        for p in (foreign, ours):
            p.kill()
            p.wait()


def _carries(pid: int, cookie: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{COOKIE_ENV}={cookie}".encode() in f.read().split(b"\0")
    except OSError:
        return False


# ------------------------------------------------------------------ item 2: reaped anywhere


async def _monitor(worker: Worker) -> None:
    await wait_exit(worker)
    worker.exited.set()


def _sleeper() -> WorkerSpec:
    argv = [sys.executable, "-c", "import time; time.sleep(600)"]
    return WorkerSpec(0, 0, argv, dict(os.environ))


async def test_worker_reaped_by_a_later_sweep_is_forgotten_first(
    freezer: Freezer,
) -> None:
    """Regression: a worker that survived SIGKILL (uninterruptible sleep) was later reaped
    by a sweep as an adopted child without the guardian being told, so a dying supervisor's
    guardian would kill whatever group had its id by then; its pidfd leaked too."""
    guardian = Guardian()
    death = DeathSignal()
    old = spawn_worker(_sleeper(), death)
    guardian.watch(old.pid)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_monitor, old)
            freezer.freeze(old.pid)
            with anyio.fail_after(WAIT):
                while proc_state(old.pid) != "D":
                    await anyio.sleep(0.01)  # the freezer gives no event
            await stop.stop_group([old], signum=signal.SIGTERM, grace=0.1,
                                  kill_now=anyio.Event(), sweep_adopted=False, kill_wait=0.2)
            assert not old.reaped and old.pid in stop.lingering()
            assert old.pid in guardian.watched  # its id is still pinned by the zombie-to-be
            (freezer.group / "freezer.state").write_text("THAWED")  # the SIGKILL lands
            with anyio.fail_after(WAIT):
                await old.exited.wait()
            # the next attempt's stop sweeps our adopted children: the old worker among them
            new = spawn_worker(_sleeper(), death)
            guardian.watch(new.pid)
            tg.start_soon(_monitor, new)
            # the sweep takes every child of ours it is not told to keep: keep all but
            # the old worker (this test process may have other children, e.g. an etcd)
            keep = [c.pid for c in psutil.Process().children() if c.pid != old.pid]
            await stop.stop_group([new], signum=signal.SIGTERM, grace=WAIT,
                                  kill_now=anyio.Event(), sweep_adopted=True, exempt=keep)
        assert old.reaped and new.reaped
        assert old.pid not in stop.lingering()
        assert not guardian.watched
        with pytest.raises(OSError) as info:
            os.fstat(old.pidfd)  # closed with the reap (unless the number was reused)
        assert info.value.errno == errno.EBADF
    finally:
        guardian.close()


def _own_group_sleeper() -> subprocess.Popen[bytes]:
    """A process of ours leading its own process group, as a worker does."""
    return subprocess.Popen(["sleep", "600"], start_new_session=True)


def _tell(guardian: Guardian, line: bytes) -> None:
    """Write a protocol line into the guardian's pipe as the supervisor would."""
    fd = os.open(f"/proc/{guardian.pid}/fd/0", os.O_WRONLY)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


async def test_registration_of_a_recycled_pid_is_ignored() -> None:
    """A registration that reaches the guardian after its pid was recycled (its message
    waited in the pipe) names another start time: the newcomer's group is not killed."""
    guardian = Guardian()
    newcomer, worker = _own_group_sleeper(), _own_group_sleeper()
    try:
        start = start_time(newcomer.pid)
        assert start is not None
        _tell(guardian, b"+ %d %d\n" % (newcomer.pid, start - 1))  # an older process's
        guardian.watch(worker.pid)
        guardian.close()
        assert worker.wait(WAIT) == -signal.SIGKILL
        assert newcomer.poll() is None
    finally:
        for p in (newcomer, worker):
            p.kill()
            p.wait()


async def test_reaping_hooks_run_while_the_worker_is_still_a_zombie() -> None:
    """The guardian must forget a group before its id can be recycled: before the reap."""
    seen: list[tuple[int, str]] = []
    remove = on_reaping(lambda pid: seen.append((pid, proc_state(pid))))
    try:
        worker = spawn_worker(_sleeper(), DeathSignal())
        worker.popen.kill()
        with anyio.fail_after(WAIT):
            await wait_exit(worker)
        worker.reap()
    finally:
        remove()
    assert seen == [(worker.pid, "Z")]


# ------------------------------------------------------------------ items 6 and 11: the daemon


ARGS = ["--health-port", "0", "--health-host", "127.0.0.1", "--nproc-per-node", "2",
        "--max-restarts", "3", "--no-warm-restart", "--shutdown-timeout", "2"]


async def health(sup: Supervised) -> str:
    m = await sup.err.expect(r"health endpoint on http://[^:]+:(\d+)")
    return f"http://127.0.0.1:{m.group(1)}"


async def workers_up(sup: Supervised, restart: int) -> list[int]:
    return [int((await sup.out.expect(rf"ready \d (\d+) {restart}$")).group(1))
            for _ in range(2)]


def fill_pipe(guardian: int) -> int:
    """Fill the guardian's stdin pipe through /proc with lines it ignores; bytes written."""
    fd = os.open(f"/proc/{guardian}/fd/0", os.O_WRONLY | os.O_NONBLOCK)
    written = 0
    try:
        for chunk in (b"#\n" * 2048, b"#\n"):
            while True:
                try:
                    written += os.write(fd, chunk)
                except BlockingIOError:
                    break
    finally:
        os.close(fd)
    return written


@pytest.fixture
async def stopped() -> AsyncIterator[list[int]]:
    """Pids the test SIGSTOPs; continued on the way out whatever happens."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


async def test_stopped_guardian_with_a_full_pipe_does_not_freeze_the_supervisor(
    tmp_path: Path, stopped: list[int]
) -> None:
    """Regression: writes to the guardian's pipe blocked the event loop once it was full
    (guardian SIGSTOPped): no probe answered, no restart happened. Now the messages wait,
    the group restarts, /healthz answers, and the guardian gets them when continued."""
    gc = tmp_path / "gc"
    args = [*ARGS, "--log-dir", str(tmp_path / "logs"), FAKE_WORKER, "--hang",
            "--grandchild", str(gc)]
    async with supervisor(args) as sup:
        url = await health(sup)
        first = await workers_up(sup, 0)
        guardian = guardian_pid(sup.pid, first)
        os.kill(guardian, signal.SIGSTOP)
        stopped.append(guardian)
        with anyio.fail_after(WAIT):  # kill() returns before the stop takes effect
            while proc_state(guardian) != "T":
                await anyio.sleep(0.01)
        assert fill_pipe(guardian) >= 4096
        os.kill(first[0], signal.SIGKILL)  # a failure: stop (forget), restart (watch)
        second = await workers_up(sup, 1)  # the loop carried on: a restart happened
        async with aiohttp.ClientSession() as session:
            with anyio.fail_after(WAIT):
                async with session.get(url + "/healthz") as resp:
                    assert resp.status == 200
        await sup.err.expect(rf"guardian \(pid {guardian}\) is not reading its pipe")
        os.kill(guardian, signal.SIGCONT)
        await sup.err.expect(rf"guardian \(pid {guardian}\) reads again")
        grandchildren = [int(Path(f"{gc}.{rank}").read_text()) for rank in range(2)]
        sup.signal(signal.SIGKILL)
        await wait_dead([*second, *grandchildren, guardian], timeout=WAIT)
        await sup.wait()


async def test_sigkilled_supervisor_leaves_no_runtime_directory(tmp_path: Path) -> None:
    """Regression: a SIGKILLed supervisor left /tmp/elastic-supervisor-run-*/ (the timer
    FIFO's directory) behind; the guardian removes it, and the workers are gone."""
    args = [*ARGS, "--log-dir", str(tmp_path / "logs"), FAKE_WORKER, "--hang"]
    async with supervisor(args) as sup:
        fifo = Path((await sup.err.expect(r"deadline FIFO at (\S+)")).group(1))
        workers = await workers_up(sup, 0)
        runtime = fifo.parent.parent
        assert re.fullmatch(r"elastic-supervisor-run-.*", runtime.name) and runtime.is_dir()
        guardian = guardian_pid(sup.pid, workers)
        sup.signal(signal.SIGKILL)
        await wait_dead([*workers, guardian], timeout=WAIT)
        await sup.wait()
    assert not runtime.exists()
