"""Warm restarts: a restarted worker runs in a pre-started interpreter (a standby) and must
be indistinguishable, from inside, from the cold start of the first attempt."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sys
from pathlib import Path

import anyio
import pytest

from tests.support.daemon import supervisor
from tests.support.eventlog import read_events, warm_ranks
from tests.support.paths import FAKE_WORKER, TESTS, WORKERS
from tests.support.processes import pid_alive, wait_dead

PROBE = str(TESTS / "workers" / "probe_main.py")
BASE = ["--health-port", "0", "--shutdown-timeout", "5", "--log-level", "debug"]
STANDBY_LINE = r"standby for local rank (\d) started as pid (\d+)"
# differ between any two attempts, cold or warm
PER_ATTEMPT_ENV = {"TORCHELASTIC_RESTART_COUNT", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE"}


def load(out: Path, restart: int, rank: int) -> dict[str, object]:
    record: dict[str, object] = json.loads((out / f"{restart}_{rank}.json").read_text())
    env = record.pop("env")
    assert isinstance(env, dict)
    record["env"] = {k: v for k, v in env.items() if k not in PER_ATTEMPT_ENV}
    return record


@pytest.mark.parametrize("form", ["script", "module", "run-path", "script-safe-path"])
async def test_warm_worker_sees_what_a_cold_one_sees(tmp_path: Path, form: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    logs = tmp_path / "logs"
    if form == "module":
        shutil.copy(PROBE, tmp_path / "probe_mod.py")
        target = ["-m", "probe_mod"]
    else:
        target = ["--run-path", PROBE] if form == "run-path" else [PROBE]
    args = [*BASE, "--nproc-per-node", "2", "--max-restarts", "2", "--log-dir", str(logs),
            "--redirects", "1", *target, str(out)]
    gate = tmp_path / "gate"
    env = {"PROBE_GATE": str(gate), **({"PYTHONSAFEPATH": "1"} if form.endswith("safe-path")
                                       else {})}
    async with supervisor(args, env=env, cwd=tmp_path) as sup:
        standbys = [int((await sup.err.expect(STANDBY_LINE)).group(2)) for _ in range(2)]
        gate.touch()  # both standbys started (one at a time): now restart 0 may fail
        assert await sup.wait() == 0
    # restart 0 ran cold and failed; restart 1 ran in the standbys and succeeded
    assert warm_ranks(logs) == [None, [0, 1]]
    for rank in range(2):
        cold, warm = load(out, 0, rank), load(out, 1, rank)
        # the two documented differences: the standby's control socket module is loaded,
        # and its own two frames sit under the user's code on the live stack
        assert set(warm.pop("modules")) - set(cold.pop("modules")) == {"_socket"}
        assert warm.pop("stack_depth") == cold.pop("stack_depth") + 2
        assert warm == cold
        assert cold["stdin"] == "/dev/null"
        assert cold["fds"] == [0, 1, 2, 3, 4]  # 3: the record being written, 4: the listing
    # the standbys of the third attempt, never used, were killed and reaped by the supervisor
    assert len(standbys) == 2
    assert not any(pid_alive(p) for p in standbys)


async def test_warm_traceback_and_error_file_match_a_cold_start(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    logs = tmp_path / "logs"
    args = [*BASE, "--max-restarts", "1", "--log-dir", str(logs), "--redirects", "2",
            PROBE, str(out), "raise"]
    async with supervisor(args) as sup:
        assert await sup.wait() == 1
        await sup.err.expect(r"root cause: local rank 0 \(pid \d+\) exited with code 1")
    assert warm_ranks(logs) == [None, [0]]
    cold, warm = ((logs / "none" / f"attempt_{i}" / "0" / "stderr.log").read_text()
                  for i in range(2))
    assert "ValueError: probe failure on rank 0" in cold
    assert warm == cold  # same frames, none of the standby's own
    exits = [e["exit_code"] for e in read_events(logs / "none" / "events.jsonl", "worker_exited")]
    assert exits == [1, 1]


async def test_warm_worker_exit_code_passes_through(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    args = [*BASE, "--max-restarts", "1", "--log-dir", str(logs), PROBE, str(tmp_path)]
    # restart 0 exits 1; the warm restart 1 exits 0: the job succeeds through the standby
    async with supervisor(args) as sup:
        await sup.out.expect(r"^probed 0 1$")
        assert await sup.wait() == 0
    assert warm_ranks(logs) == [None, [0]]


async def test_standby_killed_behind_our_back_falls_back_to_a_cold_start(
    tmp_path: Path,
) -> None:
    logs = tmp_path / "logs"
    args = [*BASE, "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", str(logs),
            FAKE_WORKER, "--hang", "--usr1-exit", "1", "--fail-rank", "0", "--fail-attempts", "1"]
    async with supervisor(args) as sup:
        rank0 = int((await sup.out.expect(r"^ready 0 (\d+) 0$")).group(1))
        standbys = {}
        for _ in range(2):
            m = await sup.err.expect(STANDBY_LINE)
            standbys[int(m.group(1))] = int(m.group(2))
        os.kill(standbys[1], signal.SIGKILL)
        await wait_dead([standbys[1]], timeout=5.0)
        os.kill(rank0, signal.SIGUSR1)  # rank 0 fails: the group restarts
        await sup.err.expect(r"standby for local rank 1 exited before it was used")
        again = {(await sup.out.expect(r"^ready (\d) \d+ 1$")).group(1) for _ in range(2)}
        assert again == {"0", "1"}
        sup.signal(signal.SIGTERM)
        assert await sup.wait() == 128 + signal.SIGTERM
    assert warm_ranks(logs) == [None, [0]]


async def test_supervisor_sigkill_takes_the_standbys_too(tmp_path: Path) -> None:
    args = [*BASE, "--nproc-per-node", "2", "--max-restarts", "3",
            "--log-dir", str(tmp_path / "logs"), FAKE_WORKER,
            "--hang"]
    async with supervisor(args) as sup:
        standbys = [int((await sup.err.expect(STANDBY_LINE)).group(2)) for _ in range(2)]
        assert all(pid_alive(p) for p in standbys)
        sup.signal(signal.SIGKILL)
        await sup.wait()
        await wait_dead(standbys, timeout=1.0)


async def test_no_warm_restart_starts_every_attempt_cold(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    args = [*BASE, "--no-warm-restart", "--max-restarts", "1", "--log-dir", str(logs),
            PROBE, str(tmp_path)]
    async with supervisor(args) as sup:
        assert await sup.wait() == 0
        assert "standby for local rank" not in sup.err.text()
    assert warm_ranks(logs) == [None, None]


# The supervisor with the pause between two standbys' starts raised far beyond any test's
# run time: a standby then starts only once the one before it has reported (or the plan
# is halted), whatever the machine's load, so the order below is the mechanism's own.


def embedded(patch: str) -> list[str]:
    """The embedded API's run (``tests/workers/embedded_run.py``: standbys that import for
    themselves, the rule where no fork server can serve) with ``patch`` applied to the
    pool's constants (``g``: the pool, ``s``: its standby set): ``PRELOAD_AFTER = 0`` has
    them start at once after a launch."""
    return [sys.executable, "-c",
            "import runpy, sys, supervisor.workers.warm.pool as g, "
            f"supervisor.workers.warm.standbyset as s; {patch}; "
            f"sys.argv[0] = {EMBEDDED_RUN!r}; runpy.run_path({EMBEDDED_RUN!r}, "
            "run_name='__main__')"]


EMBEDDED_RUN = str(WORKERS / "embedded_run.py")
EMBEDDED = embedded("g.PRELOAD_AFTER = 0.0")
PATIENT = embedded("g.PRELOAD_AFTER = 0.0; s.STAGGER = 600.0")
# A preload that takes as long as the test wants. PRELOAD_GATE is a FIFO: opening it to
# read returns once the test opens it to write. With PRELOAD_STARTED (a FIFO too) it first
# tells the test that it is importing.
GATED_PRELOAD = (WORKERS / "gated_preload.py").read_text()


def _open_gate(fifo: Path) -> None:
    """Release the preload blocked opening ``fifo`` (it is there: ENXIO otherwise)."""
    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


async def test_standbys_start_one_at_a_time(tmp_path: Path) -> None:
    """Each standby starts once the one before it has reported: eight started at once
    took the CPU from the loop (EEVDF runs a new process before it is behind the queue,
    whatever its priority)."""
    out = tmp_path / "out"
    out.mkdir()
    gate = tmp_path / "gate"
    args = [*BASE, "--nproc-per-node", "3", "--max-restarts", "1", "--log-dir",
            str(tmp_path / "logs"), "--preload", "colorsys", PROBE, str(out)]
    async with supervisor(args, env={"PROBE_GATE": str(gate)}, launcher=PATIENT) as sup:
        for _ in range(3):
            await sup.err.expect(r"standby for local rank \d preloaded colorsys")
        gate.touch()
        assert await sup.wait() == 0
    said = [m.group(1, 2) for m in re.finditer(
        r"standby for local rank (\d) (started|preloaded)", sup.err.text())]
    ranks = [rank for rank, _ in said[::2]]
    assert sorted(ranks) == ["0", "1", "2"]
    assert said == [x for r in ranks for x in ((r, "started"), (r, "preloaded"))]


async def test_a_stop_does_not_wait_for_the_standbys_yet_to_start(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "gated_preload.py").write_text(GATED_PRELOAD)
    os.mkfifo(tmp_path / "gate")  # opened by nobody: the preload never ends
    env = {"PROBE_GATE": str(tmp_path / "never"), "PRELOAD_GATE": str(tmp_path / "gate"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    args = [*BASE, "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir",
            str(tmp_path / "logs"), "--preload", "gated_preload", PROBE, str(out)]
    async with supervisor(args, env=env, cwd=tmp_path, launcher=PATIENT) as sup:
        first = int((await sup.err.expect(STANDBY_LINE)).group(2))  # importing, forever
        sup.signal(signal.SIGTERM)
        with anyio.fail_after(30):  # the pause before the next standby is 600 s
            assert await sup.wait() == 128 + signal.SIGTERM
    assert [int(m.group(2)) for m in re.finditer(STANDBY_LINE, sup.err.text())] == [first]
    await wait_dead([first], timeout=5.0)


def _policies(pid: int) -> set[int]:
    policies = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            policies.add(os.sched_getscheduler(int(tid)))
    return policies


async def test_a_worker_handed_over_mid_import_finishes_it_at_normal_priority(
        tmp_path: Path) -> None:
    """A crash while the standby still imports: the worker waits for the import (it is
    ahead of a cold start), which must then not run at idle priority any more."""
    from supervisor.workers.warm.standby import _can_raise_priority

    if not _can_raise_priority():
        pytest.skip("standbys wait at SCHED_IDLE only with CAP_SYS_NICE (run as root)")
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "gated_preload.py").write_text(GATED_PRELOAD)
    crash, importing, imported = tmp_path / "crash", tmp_path / "importing", tmp_path / "gate"
    os.mkfifo(importing)
    os.mkfifo(imported)
    env = {"PROBE_GATE": str(crash), "PRELOAD_STARTED": str(importing),
           "PRELOAD_GATE": str(imported),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    logs = tmp_path / "logs"
    args = [*BASE, "--max-restarts", "1", "--log-dir", str(logs), "--preload",
            "gated_preload", PROBE, str(out)]
    async with supervisor(args, env=env, cwd=tmp_path, launcher=EMBEDDED) as sup:
        standby = int((await sup.err.expect(STANDBY_LINE)).group(2))
        with anyio.fail_after(30):  # until its import thread is in the preload
            await anyio.to_thread.run_sync(lambda: open(importing).close(),
                                           abandon_on_cancel=True)
        assert len(os.listdir(f"/proc/{standby}/task")) == 2
        assert _policies(standby) == {os.SCHED_IDLE}  # waiting, and importing, at idle
        crash.touch()  # restart 0 exits 1: its worker goes to the standby mid-import
        await sup.err.expect(rf"local rank 0 started as pid {standby}\b")
        # set by the hand-off itself, before that line
        assert _policies(standby) == {os.SCHED_OTHER}
        _open_gate(imported)
        assert await sup.wait() == 0
    assert warm_ranks(logs) == [None, [0]]
