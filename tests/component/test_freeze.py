"""A frozen supervisor (SIGSTOP, then SIGCONT) does not kill healthy workers as hung.

Regression test for issue 18 item 9: while the supervisor was stopped, its workers went on
renewing 3 s deadlines every second; the renewals sat unread in the FIFO, and on SIGCONT the
deadline timer judged before the FIFO was read ("deadline 'step' expired 2.139 s ago").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import anyio
import pytest

from supervisor.core.deadlines import DeadlineTable, TimerRequest
from supervisor.events import EventLog
from supervisor.health.looplag import LoopLag, Stall
from supervisor.health.metrics import Metrics
from supervisor.watchdog.timers import WatchdogConfig
from tests.support.daemon import supervisor
from tests.support.paths import WORKERS
from tests.support.processes import pid_alive
from tests.support.watchdog import post, request, running_watchdog

RENEW = (WORKERS / "renewing_worker.py").read_text()

FREEZE = 5.0  # seconds the supervisor is stopped: longer than the 3 s deadlines


# ------------------------------------------------------------ the mechanism, in-process


async def test_renewal_unread_when_the_timer_fires_still_counts(tmp_path: Path) -> None:
    """The race of the frozen supervisor, made deterministic: the deadline's timer and
    the FIFO's renewal become due in one stall of the loop, and the timer's task is
    scheduled first (as after a SIGCONT, when epoll returns EINTR and no events). The
    renewal must be read before the deadline is judged."""
    child = await anyio.open_process(["sleep", "60"])
    loop = asyncio.get_running_loop()
    try:
        async with running_watchdog(tmp_path / "wd" / "timer.fifo") as h:
            h.owned[child.pid] = 0
            post(h.fifo, request(child.pid, after=0.5, scope="step"))
            await h.metrics.until(lambda: h.metrics.accepted == 1)
            [(_, _, due)] = h.watchdog.deadlines()

            def stall(seconds: float) -> None:
                time.sleep(seconds)  # the loop stands still: this is the fault

            def renew() -> None:  # posted while the loop still stands still
                post(h.fifo, request(child.pid, after=5.0, scope="step"))

            loop.call_at(due - 0.05, stall, 0.1)  # past the deadline, nothing seen yet
            loop.call_at(due + 0.01, renew)  # runs right after the timer's callback
            await h.metrics.until(lambda: h.metrics.accepted == 2)
            expired = h.watchdog.stats.expired
            [(_, _, renewed)] = h.watchdog.deadlines()
        assert renewed > due + 4 and not expired
        assert child.returncode is None
    finally:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        await child.wait()


async def test_a_stall_postpones_deadlines_that_fell_due_during_it(tmp_path: Path) -> None:
    """A stall longer than the threshold gives every worker that long again (bounded)
    before judging: its renewal may not have been written yet (the machine froze)."""
    child = await anyio.open_process(["sleep", "60"])
    loop = asyncio.get_running_loop()
    config = WatchdogConfig(kill_grace=0.5, stall_threshold=0.2, max_stall_grace=0.6)
    try:
        async with running_watchdog(tmp_path / "wd" / "timer.fifo", config) as h:
            h.owned[child.pid] = 0
            post(h.fifo, request(child.pid, after=0.2, scope="step"))
            await h.metrics.until(lambda: h.metrics.accepted == 1)
            [(_, _, due)] = h.watchdog.deadlines()
            loop.call_at(due - 0.05, time.sleep, 0.5)  # woken 0.45 s late
            event = await h.next_expiry()  # judged later, not never: it is still hung
            assert h.watchdog.stats.stalls == 1 and h.watchdog.stats.postponed == 1
            assert event.late < 0.2  # judged at the postponed time, not 0.45 s late
    finally:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        await child.wait()


def test_postpone_until_moves_only_earlier_deadlines() -> None:
    table = DeadlineTable()
    table.register(TimerRequest(10, "a", 101.0, 9), 0, now_wall=100.0, now_mono=0.0)
    table.register(TimerRequest(11, "b", 110.0, 9), 1, now_wall=100.0, now_mono=0.0)
    assert table.postpone_until(5.0) == 1
    assert [(d.pid, d.expires_at) for d in table] == [(10, 5.0), (11, 10.0)]
    assert table.pop_expired(4.9) == []
    assert [e.pid for e in table.pop_expired(5.0)] == [10]


def test_a_long_tick_is_a_stall_reported_to_listeners(tmp_path: Path) -> None:
    """Item 9: a stall becomes an event (through a listener) and counts (for metrics)."""
    log = EventLog(tmp_path / "events.jsonl", "run")
    lag = LoopLag(interval=2.0, clock=lambda: 0.0, stall_threshold=1.0)
    lag.add_listener(lambda stall: log.emit("loop_stall", **stall.fields()))
    lag.record(10.0, 12.5, boot_slept=10.0, boot_woke=12.5)  # 0.5 s late: not a stall
    lag.record(12.5, 19.5, boot_slept=12.5, boot_woke=19.5)  # 5 s late: SIGSTOP-like
    log.close()
    [record] = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert (record["event"], record["cause"], record["seconds"]) == ("loop_stall", "stall", 5.0)
    assert (lag.stalls, lag.stalled_seconds) == (1, 5.0)


def test_a_suspended_machine_is_a_stall_of_kind_suspend() -> None:
    seen: list[Stall] = []
    lag = LoopLag(interval=2.0, clock=lambda: 0.0)
    lag.add_listener(seen.append)
    # the monotonic clock advanced 2 s, CLOCK_BOOTTIME 32 s: 30 s suspended
    lag.record(100.0, 102.0, boot_slept=500.0, boot_woke=532.0)
    assert [(s.kind, s.seconds) for s in seen] == [("suspend", 30.0)]


def test_a_failing_stall_listener_does_not_stop_the_measurement(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lag = LoopLag(interval=1.0, clock=lambda: 0.0)

    def broken(stall: Stall) -> None:
        raise RuntimeError("bug in a listener")

    lag.add_listener(broken)
    assert lag.record(0.0, 4.0) == 3.0
    assert lag.stalls == 1 and "loop stall listener failed" in caplog.text


def test_metrics_export_the_stall_counts() -> None:
    metrics = Metrics()
    lag = LoopLag(interval=1.0, clock=lambda: 0.0)
    metrics.watch_loop(lag)
    lag.record(0.0, 4.5)
    text = metrics.render().decode()
    assert "elastic_supervisor_event_loop_stalls_total 1.0" in text
    assert "elastic_supervisor_event_loop_stalled_seconds_total 3.5" in text


# ------------------------------------------------------------- the real daemon, frozen


def events(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def freeze_and_check(tmp_path: Path) -> None:
    worker = tmp_path / "renew.py"
    worker.write_text(RENEW)
    log_dir = tmp_path / "logs"
    args = ["--health-port", "0", "--nproc-per-node", "2", "--max-restarts", "0",
            "--log-dir", str(log_dir), "--rdzv-id", "freeze", str(worker)]
    async with supervisor(args) as sup:
        ready = [await sup.out.expect(r"^ready (\d) (\d+) 0$") for _ in range(2)]
        pids = sorted(int(m.group(2)) for m in ready)
        for _ in range(2):
            await sup.out.expect(r"^step \d \d+ ")
        os.kill(sup.pid, signal.SIGSTOP)
        try:
            await anyio.sleep(FREEZE)  # the fault itself lasts this long; nothing to wait on
        finally:
            os.kill(sup.pid, signal.SIGCONT)
        thawed = time.time()
        await sup.err.expect(r"event loop stalled for [3-9]\.\d+ s")
        # every worker renews three more times after the thaw: an expiry judged on stale
        # deadlines would have fired at once, long before the last of these steps
        seen = {"0": 0, "1": 0}
        with anyio.fail_after(30):
            while min(seen.values()) < 3:
                m = await sup.out.expect(r"^step (\d) \d+ (\S+)$")
                if float(m.group(2)) > thawed:
                    seen[m.group(1)] += 1
        assert "expired" not in sup.err.text(), sup.err.text()
        assert all(pid_alive(pid) for pid in pids)
        sup.signal(signal.SIGTERM)
        assert await sup.wait() == 143
    kinds = [e["event"] for e in events(log_dir / "freeze" / "events.jsonl")]
    assert "deadline_expired" not in kinds
    assert "group_stopping" not in kinds or kinds.count("group_started") == 1


@pytest.mark.xdist_group("load")  # a timing bound: not beside another test's load
async def test_frozen_supervisor_keeps_healthy_workers(tmp_path: Path) -> None:
    await freeze_and_check(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("run", range(16))
async def test_frozen_supervisor_keeps_healthy_workers_16_runs(tmp_path: Path, run: int) -> None:
    await freeze_and_check(tmp_path)
