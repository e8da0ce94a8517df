"""A worker flooding the deadline FIFO cannot stall the supervisor's event loop (issue 52,
finding 4): valid requests from a descendant 60 levels deep stalled it 21 s (every line
walked up to 64 parent pids in /proc), and 1.73 s from depth 1.

Real processes (a chain of forks, the deepest floods), the real FIFO and watchdog, and
the project's loop-lag measure ticking every 10 ms: no tick may come over 100 ms late.
Its clock is the loop thread's CPU time: on a shared machine (load 17 on 2 cores when
this was written) the wall clock also counts the time the process waited for a CPU, and
slices of 3 ms of work took 50-60 ms of wall time; CPU time counts only the work the loop
did between two ticks, which is what a flood could make long.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import anyio
import pytest

from supervisor.health.looplag import LoopLag
from supervisor.watchdog.owners import MAX_DEPTH, OwnerCache
from tests.support.daemon import Stream, pump
from tests.support.paths import WORKERS
from tests.support.watchdog import running_watchdog

pytestmark = pytest.mark.xdist_group("load")  # a timing bound: not beside another's load

FLOOD = 3.0  # seconds of flood measured
MAX_STALL = 0.1


@pytest.mark.parametrize(("depth", "outcome"), [(1, "accepted"), (60, "not_owned")])
async def test_a_deadline_flood_never_stalls_the_loop(
    tmp_path: Path, depth: int, outcome: str
) -> None:
    lag = LoopLag(interval=0.01, clock=time.thread_time, stall_threshold=MAX_STALL,
                  boot_clock=time.thread_time)
    chain = await anyio.open_process(
        [sys.executable, str(WORKERS / "deadline_flood.py"), str(tmp_path / "wd" / "timer.fifo"),
         str(depth)], start_new_session=True)
    owners = OwnerCache(lambda: {chain.pid: 0})  # the top of the chain is the worker
    said = Stream()
    try:
        async with running_watchdog(tmp_path / "wd" / "timer.fifo", owner=owners) as h, \
                anyio.create_task_group() as tg:
            assert chain.stdout is not None
            tg.start_soon(pump, chain.stdout, said)
            await said.expect(r"^flooding \d+$")
            await tg.start(lag.run)
            with anyio.move_on_after(FLOOD):
                while True:
                    await lag.next_tick()
            tg.cancel_scope.cancel()
    finally:
        os.killpg(chain.pid, signal.SIGKILL)
        await chain.aclose()  # waits for it and closes its pipes
        owners.close()
    handled = h.metrics.accepted if outcome == "accepted" else h.metrics.rejected[outcome]
    assert handled > 10_000, (h.metrics.accepted, h.metrics.rejected)  # it was a flood
    assert lag.stalls == 0, lag.last_stall
    assert depth <= MAX_DEPTH or h.metrics.accepted == 0
