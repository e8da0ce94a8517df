"""The node's fork server over a run: a failed or dead server means cold starts, a new
server, one warning and a count; a preload that reads a rank's variable is left out."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from supervisor.core.envs import PER_ATTEMPT_ENV, interpreter
from supervisor.workers.spawn import DeathSignal
from supervisor.workers.warm.forkserver import ForkServerConfig, Wanted
from supervisor.workers.warm.forkslot import ForkSlot
from tests.support.paths import REPO


@contextlib.asynccontextmanager
async def running_slot() -> AsyncIterator[ForkSlot]:
    made = ForkSlot(death=DeathSignal(), prefix=interpreter(sys.executable))
    async with anyio.create_task_group() as tg:
        await tg.start(made.run)
        with anyio.fail_after(60):
            yield made
        tg.cancel_scope.cancel()
    assert made.pids() == set()  # its servers are stopped with it


def config(tmp_path: Path, *preload: str, code: str = "") -> ForkServerConfig:
    pp = tmp_path / "pp"
    pp.mkdir(exist_ok=True)
    (pp / "reader.py").write_text(code)
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": f"{pp}:{REPO}"}
    return ForkServerConfig(python=sys.executable, env=env, cwd=str(tmp_path),
                            path0=str(tmp_path), preload=preload,
                            watch=(*PER_ATTEMPT_ENV, "LOCAL_RANK"))


async def test_a_failed_preload_is_counted_and_warned_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    bad = config(tmp_path, "no_such_module_here")
    async with running_slot() as slot:
        assert not await slot.prepare(bad)
        assert not await slot.prepare(bad)  # a new server, failing again
        assert slot.failures["preload"] == 2
        assert slot.pids() == set()  # nothing left running
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "start cold" in warnings[0].getMessage()


async def test_a_dead_server_is_replaced_by_the_next_prepare(tmp_path: Path) -> None:
    good = config(tmp_path, "xml.dom.minidom")
    async with running_slot() as slot:
        assert await slot.prepare(good)
        first = slot.server
        assert first is not None
        os.kill(first.pid, signal.SIGKILL)
        os.waitid(os.P_PIDFD, first.process.pidfd, os.WEXITED | os.WNOWAIT)
        assert slot.fork([Wanted(0, {})]) is None  # the rank starts cold
        assert slot.failures["died"] == 1
        assert await slot.prepare(good)
        assert slot.server is not None and slot.server.pid != first.pid


async def test_a_fork_asked_of_a_server_just_killed_says_how_it_died(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The next fork is often what finds a dead server, before its exit can be read: the
    warning still says how it died (a CI run said only "fork refused: ... exited")."""
    async with running_slot() as slot:
        assert await slot.prepare(config(tmp_path, "xml.dom.minidom"))
        first = slot.server
        assert first is not None
        os.kill(first.pid, signal.SIGKILL)  # no wait: the fork comes at once
        assert await anyio.to_thread.run_sync(slot.fork, [Wanted(0, {})]) is None
        assert slot.failures["died"] == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert f"fork server (pid {first.pid}) died: killed by signal 9" in warnings[0], warnings


async def test_a_tainted_package_is_left_out_of_the_next_server(tmp_path: Path) -> None:
    tainted = config(tmp_path, "xml.dom.minidom", "reader",
                     code="import os\nos.environ.get('LOCAL_RANK')\n")
    async with running_slot() as slot:
        assert await slot.prepare(tainted)  # after a retry without it
        assert slot.excluded == {"reader"}
        assert slot.failures["tainted"] == 1
        assert slot.server is not None
        assert slot.server.config.preload == ("xml.dom.minidom",)
