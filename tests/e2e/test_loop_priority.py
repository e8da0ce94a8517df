"""The event loop runs ahead of the workers it starts, and the workers do not (issue 29).

As root the daemon's event-loop thread gets ``--loop-nice`` (default 0: nothing) and, when it
leads its own session, its autogroup too; every other thread of it, every worker (cold,
from a standby, forked from the fork server) and every worker's autogroup stays at nice
0, ``SCHED_OTHER``, without ``SCHED_RESET_ON_FORK``. A supervisor started inside someone
else's session leaves that session's autogroup alone, and one started at a nice value of
its own keeps it (its workers inherit it, as under torchrun). The non-root case (nothing
raised, one line saying why) is in test_service.py's run as user nobody.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemon import Supervised, supervisor
from tests.support.paths import WORKERS

PROBE = str(WORKERS / "priority_probe.py")
SUPERVISOR = [sys.executable, "-m", "supervisor", "run"]

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CAP_SYS_NICE) to raise a "
                                                 "priority: run the tests as root"),
    pytest.mark.skipif(shutil.which("setsid") is None,
                       reason="needs util-linux setsid (apt-get install util-linux)"),
]


def own_session() -> list[str]:
    """The supervisor as a session leader, as systemd starts a service (setsid execs in
    place: the child of the test is no process-group leader, so it does not fork)."""
    return [shutil.which("setsid") or "setsid", *SUPERVISOR]


async def records(sup: Supervised, count: int) -> list[dict[str, Any]]:
    """The next ``count`` JSON lines the probes printed."""
    return [json.loads((await sup.out.expect(r"^\{.*\}$")).group(0)) for _ in range(count)]


def assert_workers_at_normal_priority(found: list[dict[str, Any]]) -> None:
    for r in found:
        assert (r["nice"], r["policy"], r["reset_on_fork"]) == (0, os.SCHED_OTHER, False), r
        assert r["autogroup"] in (0, None), r  # a session of its own: a fresh autogroup
        assert set(r["other_threads"].values()) <= {0}, r  # spawner, AnyIO's threads


@pytest.mark.parametrize("warm", [[], ["--preload", "json"]], ids=["standby", "forked"])
async def test_loop_is_raised_and_workers_are_not(tmp_path: Path, warm: list[str]) -> None:
    args = ["--nproc-per-node", "2", "--max-restarts", "1", "--health-port", "0",
            "--loop-nice", "-15", "--log-dir", str(tmp_path / "logs"), "--log-level",
            "debug", *warm, PROBE]
    go = tmp_path / "go"
    env = {"PROBE_FAIL_ATTEMPT": "0", "PROBE_DIR": str(tmp_path), "PROBE_GO": str(go)}
    async with supervisor(args, env=env,
                          launcher=own_session()) as sup:
        found = await records(sup, 2)  # attempt 0 (cold, or forked with --preload)
        if not warm:  # rank 0 fails once both standbys run (they start one after another)
            for _ in range(2):
                await sup.err.expect(r"standby for local rank \d started as pid \d+")
        go.touch()
        found += await records(sup, 2)  # attempt 1, from the standbys
        assert await sup.wait() == 0
    assert sorted((r["attempt"], r["rank"]) for r in found) == [(0, 0), (0, 1), (1, 0),
                                                                  (1, 1)]
    assert {r["parent"] for r in found} == {sup.pid}
    assert {(r["loop_nice"], r["parent_autogroup"]) for r in found} == {(-15, -15)}
    assert_workers_at_normal_priority(found)
    assert "event loop at nice -15 (its autogroup too, nice -15)" in sup.err.text()
    started = [e for e in _events(tmp_path) if e["event"] == "group_started"]
    assert started[1].get("warm") == [0, 1]  # attempt 1 really ran in the standbys


async def test_the_default_loop_nice_0_changes_nothing(tmp_path: Path) -> None:
    args = ["--nproc-per-node", "1", "--health-port", "0",
            "--log-dir", str(tmp_path / "logs"), PROBE]
    async with supervisor(args, launcher=own_session()) as sup:
        (found,) = await records(sup, 1)
        assert await sup.wait() == 0
    assert (found["loop_nice"], found["parent_autogroup"]) == (0, 0)
    assert_workers_at_normal_priority([found])


async def test_someone_elses_session_keeps_its_autogroup(tmp_path: Path) -> None:
    """Started from a shell, the autogroup is the terminal's: not ours to raise."""
    with open("/proc/self/autogroup", encoding="ascii") as f:
        before = f.read()
    args = ["--nproc-per-node", "1", "--health-port", "0", "--loop-nice", "-15",
            "--log-dir", str(tmp_path / "logs"), PROBE]
    async with supervisor(args) as sup:  # in this test's session
        (found,) = await records(sup, 1)
        assert await sup.wait() == 0
    assert found["loop_nice"] == -15
    # empty where this session is init's (the root group: no autogroup to raise)
    assert found["parent_autogroup"] == (int(before.split()[-1]) if before.strip() else None)
    with open("/proc/self/autogroup", encoding="ascii") as f:
        assert f.read() == before
    assert_workers_at_normal_priority([found])
    assert "event loop at nice -15; workers start at nice 0" in sup.err.text()


async def test_a_nice_value_given_at_start_is_kept(tmp_path: Path) -> None:
    nice = shutil.which("nice")
    if nice is None:
        pytest.skip("needs coreutils nice (apt-get install coreutils)")
    args = ["--nproc-per-node", "1", "--health-port", "0", "--loop-nice", "-15",
            "--log-dir", str(tmp_path / "logs"), PROBE]
    async with supervisor(args, launcher=[nice, "-n", "3", *SUPERVISOR]) as sup:
        (found,) = await records(sup, 1)
        assert await sup.wait() == 0
    assert (found["loop_nice"], found["nice"]) == (3, 3)  # the workers inherit it
    assert "event loop at nice 3: started at a priority of its own, kept" in sup.err.text()


def _events(tmp_path: Path) -> list[dict[str, Any]]:
    (log,) = (tmp_path / "logs").glob("*/events.jsonl")
    return [json.loads(line) for line in log.read_text().splitlines()]
