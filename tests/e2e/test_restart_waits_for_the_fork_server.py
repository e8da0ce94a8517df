"""A crash while the node's fork server still imports: the restart waits for the server
when that is sooner than a cold start, and starts cold when it is not.

The preload is ``tests/workers/gated_preload.py``: it blocks on a FIFO until the test
opens it, so the server is importing for exactly as long as the test wants."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from tests.support import deps
from tests.support.daemon import supervisor
from tests.support.eventlog import warm_ranks
from tests.support.paths import FAKE_WORKER, REPO, WORKERS
from tests.support.users import as_user, python_for

BASE = ["--health-port", "0", "--shutdown-timeout", "5", "--log-level", "debug",
        "--max-restarts", "1"]
WAITING = r"waiting for the fork server \(importing for [\d.]+ s\) rather than starting cold"


def gated(tmp_path: Path) -> tuple[dict[str, str], Path, Path]:
    """The environment of a supervisor whose preload blocks on ``gate``; it writes
    ``started`` when it has begun."""
    (tmp_path / "gated_preload.py").write_text((WORKERS / "gated_preload.py").read_text())
    gate, started = tmp_path / "gate", tmp_path / "started"
    os.mkfifo(gate)
    env = {"PRELOAD_GATE": str(gate), "PRELOAD_STARTED": str(started),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    return env, gate, started


async def wait_for_file(path: Path, timeout: float = 30.0) -> None:
    with anyio.fail_after(timeout):
        while not path.exists():
            await anyio.sleep(0.02)


def open_gate(fifo: Path) -> None:
    """Blocks until the preload opens the FIFO to read, then lets it go on."""
    os.close(os.open(fifo, os.O_WRONLY))


async def test_a_crash_during_the_import_waits_for_the_fork_server_and_restarts_warm(
    tmp_path: Path
) -> None:
    env, gate, started = gated(tmp_path)
    logs = tmp_path / "logs"
    args = [*BASE, "--log-dir", str(logs), "--preload", "gated_preload", FAKE_WORKER,
            "--hang", "--usr1-exit", "1", "--fail-attempts", "1"]
    async with supervisor(args, env=env, cwd=tmp_path) as sup:
        pid = int((await sup.out.expect(r"^ready 0 (\d+) 0$", timeout=30)).group(1))
        await wait_for_file(started)  # the server is importing, and will until the gate
        os.kill(pid, signal.SIGUSR1)  # the worker exits 1
        await sup.err.expect(WAITING + "$", timeout=30)  # no progress seen: cost unknown
        with anyio.fail_after(30):
            await anyio.to_thread.run_sync(open_gate, gate)
        await sup.err.expect(r"fork server \(pid \d+\) ready", timeout=30)
        await sup.out.expect(r"^ready 0 \d+ 1$", timeout=30)
        sup.signal(signal.SIGTERM)
        await sup.wait(timeout=30)
    assert warm_ranks(logs) == [None, [0]]


async def test_the_wait_ends_after_a_cold_start_s_worth_and_the_ranks_start_cold(
    tmp_path: Path
) -> None:
    """The first attempt showed progress (a ``--progress-pattern`` line): the node knows
    what a cold start costs, and waits no longer than that for a server stuck importing."""
    env, _gate, started = gated(tmp_path)
    logs = tmp_path / "logs"
    args = [*BASE, "--log-dir", str(logs), "--preload", "gated_preload",
            "--progress-pattern", "^ready", "--tee", "3",  # the lines pass through us
            FAKE_WORKER, "--hang", "--usr1-exit", "1", "--fail-attempts", "1"]
    async with supervisor(args, env=env, cwd=tmp_path) as sup:
        pid = int((await sup.out.expect(r"ready 0 (\d+) 0$", timeout=30)).group(1))
        await wait_for_file(started)
        os.kill(pid, signal.SIGUSR1)  # the worker exits 1
        await sup.err.expect(WAITING + r" \(at most [\d.]+ s, a cold start\)", timeout=30)
        await sup.err.expect("the fork server is not ready: the ranks start cold", timeout=30)
        await sup.out.expect(r"ready 0 \d+ 1$", timeout=30)
        sup.signal(signal.SIGTERM)
        await sup.wait(timeout=30)
    assert warm_ranks(logs) == [None, None]


def autogroup_nice(pid: int) -> int | None:
    with open(f"/proc/{pid}/autogroup", encoding="ascii") as f:
        fields = f.read().split()  # "/autogroup-123 nice 0"; empty: none
    return int(fields[-1]) if fields else None


async def test_the_import_runs_at_nice_19_in_its_autogroup_and_the_forks_at_0(
    tmp_path: Path
) -> None:
    """A thread's SCHED_IDLE counts only within its session's autogroup, so the server's
    group is at nice 19 while the preload imports (the import then yields to the event
    loop and the workers of the node's other sessions), and back at 0 for the forks."""
    if not Path("/proc/self/autogroup").exists():
        pytest.skip("needs a kernel with autogroups (CONFIG_SCHED_AUTOGROUP)")
    env, gate, started = gated(tmp_path)
    env["PRELOAD_IDS"] = str(tmp_path / "ids")
    args = [*BASE, "--log-dir", str(tmp_path / "logs"), "--preload", "gated_preload",
            FAKE_WORKER, "--hang"]
    async with supervisor(args, env=env, cwd=tmp_path) as sup:
        await wait_for_file(started)
        pid, tid = (int(n) for n in (tmp_path / "ids").read_text().split())
        assert os.getsid(pid) == pid  # a session (and so an autogroup) of its own
        assert autogroup_nice(pid) == 19
        assert os.sched_getscheduler(tid) == os.SCHED_IDLE
        assert os.sched_getscheduler(pid) == os.SCHED_OTHER  # the main thread, that forks
        with anyio.fail_after(30):
            await anyio.to_thread.run_sync(open_gate, gate)
        await sup.err.expect(rf"fork server \(pid {pid}\) ready", timeout=30)
        assert autogroup_nice(pid) == 0
        await sup.err.expect(r"standby for local rank 0 forked as pid \d+", timeout=30)
        sup.signal(signal.SIGTERM)
        await sup.wait(timeout=30)
    assert "autogroup stays at nice 19" not in sup.err.text()


NOBODY = "65534"

# What the server does around its import, run as user nobody in a session of its own: the
# kernel lets anyone raise their autogroup's nice value and set it back to 0, but without
# CAP_SYS_ADMIN only one such write per 100 ms on the whole machine (EAGAIN otherwise),
# which the server's second write meets at once here.
UNPRIVILEGED = """
import _thread, importlib.util, os, sys
os.setsid()
spec = importlib.util.spec_from_file_location("server", sys.argv[1])
server = importlib.util.module_from_spec(spec)
spec.loader.exec_module(server)

def nice():
    with open("/proc/self/autogroup") as f:
        return int(f.read().split()[-1])

print(server._set_autogroup_nice(19, _thread), nice())
print(server._set_autogroup_nice(0, _thread), nice())
"""


def test_an_unprivileged_server_sets_its_autogroup_to_19_and_back() -> None:
    if os.geteuid() != 0:
        deps.missing("root, to drop to user nobody (run the tests as root, as .ci/run does)")
    deps.need_binary("setpriv", "apt-get install util-linux")
    if not Path("/proc/self/autogroup").exists():
        pytest.skip("needs a kernel with autogroups (CONFIG_SCHED_AUTOGROUP)")
    python = python_for(NOBODY)
    if python is None:
        deps.missing("a Python of this version that user nobody can run; apt-get install "
                     "python3")
    with tempfile.TemporaryDirectory(dir="/tmp") as where:  # pytest's tmp is root's only
        Path(where).chmod(0o755)
        program = Path(where) / "forkserver_main.py"
        shutil.copy(REPO / "supervisor" / "workers" / "warm" / "forkserver_main.py", program)
        out = subprocess.run([*as_user(NOBODY), python, "-I", "-c", UNPRIVILEGED,
                              str(program)], capture_output=True, text=True, timeout=60,
                             cwd=where)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["True 19", "True 0"], out.stdout
