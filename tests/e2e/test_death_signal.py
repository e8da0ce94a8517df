"""The workers' parent-death signal with an older ``setpriv`` (issue 18, item 1).

util-linux's ``setpriv`` has ``--pdeathsig`` only since 2.33; with an older one every worker
failed to start. ``tests/data/old-setpriv/setpriv`` is test data standing in for such a
setpriv (it refuses the option as 2.31/2.32 do and passes anything else to the real one).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from tests.support.daemon import supervisor
from tests.support.paths import FAKE_WORKER, REPO, TESTS, WORKERS
from tests.support.processes import wait_dead

OLD = TESTS / "data" / "old-setpriv"
WAIT = 20.0

pytestmark = pytest.mark.skipif(
    shutil.which("setpriv") is None, reason="needs util-linux setpriv (apt-get install util-linux)"
)

# a process that spawns one sleeping worker the way the supervisor does, then waits
PARENT = (WORKERS / "death_signal_parent.py").read_text()


def with_old_setpriv() -> dict[str, str]:
    return {**os.environ, "PATH": f"{OLD}{os.pathsep}{os.environ.get('PATH', '')}"}


async def kill_parent_and_see_worker_die(env: dict[str, str]) -> str:
    """Start PARENT, SIGKILL it, wait for its worker to die; returns the death signal kind."""
    env = {**env, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT], env=env, stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        with anyio.fail_after(WAIT):
            line = await anyio.to_thread.run_sync(parent.stdout.readline)
        kind, pid = line.decode().split()
        with anyio.fail_after(WAIT):  # past the wrapper (which sets the signal) into sleep
            while _cmdline(int(pid)).split(b"\0")[:2] != [sys.executable.encode(), b"-c"]:
                await anyio.sleep(0.01)  # exec is no event we can wait on
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        await wait_dead([int(pid)], timeout=WAIT)  # the kernel's parent-death signal
        return kind
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


async def test_worker_dies_with_its_parent_through_setpriv() -> None:
    assert await kill_parent_and_see_worker_die(dict(os.environ)) == "setpriv"


async def test_worker_dies_with_its_parent_through_the_shim_when_setpriv_is_old() -> None:
    assert await kill_parent_and_see_worker_die(with_old_setpriv()) == "shim"


async def test_job_runs_with_a_setpriv_that_rejects_pdeathsig(tmp_path: Path) -> None:
    """Regression: every worker and standby failed to start and the job exited 1 after its
    whole restart budget. Now the option is probed once, the shim is used, and the
    start-up log says which one."""
    args = ["--nproc-per-node", "2", "--max-restarts", "2", "--log-dir", str(tmp_path),
            FAKE_WORKER, "--exit", "0"]
    async with supervisor(args, env={"PATH": with_old_setpriv()["PATH"]}) as sup:
        assert await sup.wait(WAIT) == 0
    assert "worker death signal: Python shim" in sup.err.text()
    assert f"{OLD / 'setpriv'} rejects --pdeathsig" in sup.err.text()
    assert sup.out.text().count("ready") == 2  # one attempt, both ranks ran
