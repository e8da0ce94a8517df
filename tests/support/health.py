"""A real health server on a loopback port, fed constructed snapshots."""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
import anyio
from msgspec.structs import replace

from supervisor.core.statusview import ProgressTable, RendezvousView, StatusView, WorkerView
from supervisor.health.metrics import Metrics
from supervisor.health.server import NoticeSink, serve_health


def make_status_view(phase: str = "running") -> StatusView:
    workers = tuple(
        WorkerView(local_rank=i, global_rank=i, pid=4000 + i, state="running", started_at=1.0)
        for i in range(2)
    )
    return StatusView(
        run_id="job-7", phase=phase, attempt=1, restart_count=0, max_restarts=3,
        restarts_left=3, world_size=2, local_world_size=2, role="default",
        published_at=time.monotonic(), started_at_wall=time.time(), workers=workers,
        rendezvous=RendezvousView("static", round=1, members=("node0",)),
        watchdog_enabled=True, progress_timeout=30.0,
    )


@dataclass
class Harness:
    """What a test controls: the published snapshot, progress, metrics and loop lag."""

    snapshot: StatusView = field(default_factory=make_status_view)
    progress: ProgressTable = field(default_factory=ProgressTable)
    metrics: Metrics = field(default_factory=Metrics)
    lag: float = 0.0
    broken: bool = False  # makes the snapshot source raise, like a bug in a reader

    def current(self) -> StatusView:
        if self.broken:
            raise RuntimeError("bug in a reader")
        return self.snapshot

    def current_lag(self) -> float:
        return self.lag

    def set_phase(self, phase: str) -> None:
        self.snapshot = replace(self.snapshot, phase=phase, published_at=time.monotonic())


@asynccontextmanager
async def running_server(h: Harness, notices: NoticeSink | None = None
                         ) -> AsyncIterator[tuple[aiohttp.ClientSession, int]]:
    """Start the server on a free port; yield a client bound to it; stop it on exit."""
    async with anyio.create_task_group() as tg:
        _, port = await tg.start(functools.partial(
            serve_health, "127.0.0.1", 0, h.current, h.progress, h.metrics, h.current_lag,
            notices=notices))
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as client:
            yield client, port
        tg.cancel_scope.cancel()
