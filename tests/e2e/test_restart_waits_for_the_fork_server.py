"""The node's fork server imports at normal priority, the first attempt waits for its
import and starts in interpreters forked from it; a crash while a replacement server
imports waits for it when that is sooner than a cold start, and starts cold when not.

The preload is ``tests/workers/gated_preload.py``: it blocks on a FIFO until the test
opens it, so the server is importing for exactly as long as the test wants."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import anyio
import anyio.to_thread

from tests.support.daemon import Supervised, supervisor
from tests.support.eventlog import read_events, warm_ranks
from tests.support.paths import FAKE_WORKER, WORKERS

BASE = ["--health-port", "0", "--shutdown-timeout", "5", "--log-level", "debug",
        "--max-restarts", "2"]
WAITING = (r"waiting for the fork server \(importing for [\d.]+ s\) rather than starting "
           r"cold \(at most ([\d.]+) s, a cold start\)")
READY = r"fork server \(pid (\d+)\) ready"
# the first server's import is held this long: a restart waits for a replacement at most
# what that import took (no cold start was seen), which must outlast the test's own steps
HOLD = 5.0


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


async def test_the_first_attempt_waits_for_the_import_at_normal_priority(
    tmp_path: Path
) -> None:
    """No worker starts while the server imports (at nice 0, ``SCHED_OTHER``, like a cold
    worker's import); then the first attempt runs in an interpreter forked from it."""
    env, gate, started = gated(tmp_path)
    env["PRELOAD_IDS"] = str(tmp_path / "ids")
    logs = tmp_path / "logs"
    args = [*BASE, "--log-dir", str(logs), "--preload", "gated_preload", FAKE_WORKER]
    async with supervisor(args, env=env, cwd=tmp_path) as sup:
        await sup.err.expect("the first attempt waits for the fork server's import",
                             timeout=30)
        await wait_for_file(started)
        pid, tid = (int(n) for n in (tmp_path / "ids").read_text().split())
        assert (os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)) \
            == (os.SCHED_OTHER, 0)
        assert autogroup_nice(pid) in (0, None)
        assert read_events(logs / "none" / "events.jsonl", "group_started") == []
        with anyio.fail_after(30):
            await anyio.to_thread.run_sync(open_gate, gate)
        await sup.err.expect(rf"fork server \(pid {pid}\) ready", timeout=30)
        assert await sup.wait(timeout=30) == 0
    assert warm_ranks(logs) == [[0]]


async def crash_while_a_replacement_imports(sup: Supervised, gate: Path,
                                            started: Path) -> float:
    """The first server ready (after ``HOLD`` s), attempt 0 forked from it; the server
    killed; attempt 1 from the standby forked before, its launch starting a replacement
    that imports (held at the gate) when attempt 1 crashes. The wait's bound."""
    await wait_for_file(started)
    started.unlink()
    await anyio.sleep(HOLD)  # not a synchronisation: the first import's length
    with anyio.fail_after(30):
        await anyio.to_thread.run_sync(open_gate, gate)
    server = int((await sup.err.expect(READY, timeout=30)).group(1))
    worker = int((await sup.out.expect(r"^ready 0 (\d+) 0$", timeout=30)).group(1))
    await sup.err.expect(r"standby for local rank 0 forked as pid \d+", timeout=30)
    os.kill(server, signal.SIGKILL)
    os.kill(worker, signal.SIGUSR1)  # exits 1: attempt 1 starts in the standby
    worker = int((await sup.out.expect(r"^ready 0 (\d+) 1$", timeout=30)).group(1))
    await wait_for_file(started)  # the replacement is importing, until the gate opens
    os.kill(worker, signal.SIGUSR1)
    return float((await sup.err.expect(WAITING, timeout=30)).group(1))


async def test_a_crash_while_a_replacement_imports_waits_for_it_and_restarts_warm(
    tmp_path: Path
) -> None:
    env, gate, started = gated(tmp_path)
    logs = tmp_path / "logs"
    args = [*BASE, "--log-dir", str(logs), "--preload", "gated_preload", FAKE_WORKER,
            "--hang", "--usr1-exit", "1", "--fail-attempts", "2"]
    async with supervisor(args, env=env, cwd=tmp_path) as sup:
        bound = await crash_while_a_replacement_imports(sup, gate, started)
        assert bound >= HOLD
        with anyio.fail_after(30):
            await anyio.to_thread.run_sync(open_gate, gate)
        await sup.err.expect(READY, timeout=30)
        await sup.out.expect(r"^ready 0 \d+ 2$", timeout=30)
        sup.signal(signal.SIGTERM)
        await sup.wait(timeout=30)
    assert "the fork server is not ready" not in sup.err.text()
    assert warm_ranks(logs) == [[0], [0], [0]]


async def test_the_wait_ends_after_what_the_last_import_took_and_the_ranks_start_cold(
    tmp_path: Path
) -> None:
    env, _gate, started = gated(tmp_path)
    logs = tmp_path / "logs"
    args = [*BASE, "--log-dir", str(logs), "--preload", "gated_preload", FAKE_WORKER,
            "--hang", "--usr1-exit", "1", "--fail-attempts", "2"]
    async with supervisor(args, env=env, cwd=tmp_path) as sup:
        await crash_while_a_replacement_imports(sup, _gate, started)
        await sup.err.expect("the fork server is not ready: the ranks start cold", timeout=60)
        await sup.out.expect(r"^ready 0 \d+ 2$", timeout=30)
        sup.signal(signal.SIGTERM)
        await sup.wait(timeout=30)
    assert warm_ranks(logs) == [[0], [0], None]


def autogroup_nice(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/autogroup", encoding="ascii") as f:
            fields = f.read().split()  # "/autogroup-123 nice 0"; empty: none
    except FileNotFoundError:  # a kernel without autogroups
        return None
    return int(fields[-1]) if fields else None


async def test_a_stop_while_the_first_attempt_waits_for_the_import_ends_the_run(
    tmp_path: Path
) -> None:
    """The import never ends (the gate stays shut): SIGTERM still stops the supervisor
    at once, with no worker started."""
    env, _gate, started = gated(tmp_path)
    logs = tmp_path / "logs"
    args = [*BASE, "--log-dir", str(logs), "--preload", "gated_preload", FAKE_WORKER]
    async with supervisor(args, env=env, cwd=tmp_path) as sup:
        await sup.err.expect("the first attempt waits for the fork server's import",
                             timeout=30)
        await wait_for_file(started)
        sup.signal(signal.SIGTERM)
        assert await sup.wait(timeout=30) == 128 + signal.SIGTERM
    assert read_events(logs / "none" / "events.jsonl", "group_started") == []
