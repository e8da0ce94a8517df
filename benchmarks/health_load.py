"""Load the health endpoint: open-loop requests at a fixed rate, report latency and errors.

    python benchmarks/health_load.py load --url http://127.0.0.1:29480/healthz \\
        --rate 2000 --duration 10
    python benchmarks/health_load.py serve --port 0    # a stand-alone server to aim at

``load`` schedules one request every 1/rate seconds whatever the server does (open loop),
and measures each latency from its *scheduled* time, so a stalled server shows up as
latency instead of silently lowering the offered rate (coordinated omission). In-flight
requests are capped by ``--concurrency``; a request that cannot start because the cap is
reached still counts its waiting time. Only loopback targets make sense here.

Prints: offered and achieved rate, p50/p90/p99/max latency, errors (non-2xx, 503
counted separately since a stuck supervisor answers 503 on purpose, and exceptions).
Exit code 0 if no request failed with an exception or a 5xx other than 503.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp


@dataclass
class Results:
    """Per-request outcomes of one load run."""

    latencies: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    exceptions: Counter[str] = field(default_factory=Counter)
    elapsed: float = 0.0

    @property
    def sent(self) -> int:
        return len(self.latencies)

    @property
    def errors(self) -> int:
        bad = sum(n for code, n in self.statuses.items() if code >= 500 and code != 503)
        return bad + sum(self.exceptions.values())


async def one_request(
    session: aiohttp.ClientSession, url: str, scheduled: float, results: Results
) -> None:
    try:
        async with session.get(url) as resp:
            await resp.read()
            results.statuses[resp.status] += 1
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        results.exceptions[type(exc).__name__] += 1
    results.latencies.append(time.perf_counter() - scheduled)


async def drive(url: str, rate: float, duration: float, concurrency: int) -> Results:
    """Offer ``rate`` requests/s for ``duration`` seconds; wait for the stragglers.

    The client's own heap is frozen meanwhile: a full collection in this process stalled
    its loop 10-14 ms, and each such stall would count as the server's latency (every
    request is timed from when it was due, not from when it was sent)."""
    gc.collect()
    gc.freeze()
    try:
        return await _drive(url, rate, duration, concurrency)
    finally:
        gc.unfreeze()


async def _drive(url: str, rate: float, duration: float, concurrency: int) -> Results:
    results = Results()
    limit = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks: set[asyncio.Task[None]] = set()
        start = time.perf_counter()
        total = int(rate * duration)
        for i in range(total):
            scheduled = start + i / rate
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await limit.acquire()
            task = asyncio.create_task(one_request(session, url, scheduled, results))
            tasks.add(task)
            task.add_done_callback(_finisher(tasks, limit))
        if tasks:
            await asyncio.wait(tasks)
        results.elapsed = time.perf_counter() - start
    return results


def _finisher(
    tasks: set[asyncio.Task[None]], limit: asyncio.Semaphore
) -> Callable[[asyncio.Task[None]], None]:
    def done(task: asyncio.Task[None]) -> None:
        tasks.discard(task)
        limit.release()

    return done


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def report(results: Results, rate: float, as_json: bool) -> dict[str, object]:
    lat = sorted(results.latencies)
    summary: dict[str, object] = {
        "offered_rate": rate,
        "achieved_rate": round(results.sent / results.elapsed, 1) if results.elapsed else 0.0,
        "requests": results.sent,
        "p50_ms": round(percentile(lat, 0.50) * 1e3, 3),
        "p90_ms": round(percentile(lat, 0.90) * 1e3, 3),
        "p99_ms": round(percentile(lat, 0.99) * 1e3, 3),
        "max_ms": round((lat[-1] if lat else float("nan")) * 1e3, 3),
        "mean_ms": round(statistics.fmean(lat) * 1e3, 3) if lat else None,
        "statuses": dict(sorted(results.statuses.items())),
        "exceptions": dict(results.exceptions),
        "errors": results.errors,
    }
    if as_json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            print(f"{key:14} {value}")
    return summary


async def serve(host: str, port: int) -> None:
    """A stand-alone health server with a static running snapshot, for trying the load."""
    import anyio

    from supervisor.core.statusview import ProgressTable, StatusView, WorkerView
    from supervisor.health.looplag import LoopLag
    from supervisor.health.metrics import Metrics
    from supervisor.health.server import serve_health

    workers = tuple(WorkerView(i, i, None, "running", time.time()) for i in range(4))
    snap = StatusView("bench", "running", 1, 0, 3, 3, 4, 4, "default", time.monotonic(),
                    time.time(), workers=workers)
    lag = LoopLag()
    async with anyio.create_task_group() as tg:
        await tg.start(lag.run)
        bound = await tg.start(
            serve_health, host, port, lambda: snap, ProgressTable(), Metrics(), lag.current
        )
        print(f"serving on http://{bound[0]}:{bound[1]}/healthz", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    load = sub.add_parser("load", help="drive requests at a URL")
    load.add_argument("--url", default="http://127.0.0.1:29480/healthz")
    load.add_argument("--rate", type=float, default=2000.0, help="requests per second")
    load.add_argument("--duration", type=float, default=10.0, help="seconds (max 600)")
    load.add_argument("--concurrency", type=int, default=64, help="max in-flight requests")
    load.add_argument("--json", action="store_true", help="one JSON line instead of a table")
    srv = sub.add_parser("serve", help="run a stand-alone health server to aim at")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=0)
    ns = p.parse_args(argv)
    if ns.cmd == "serve":
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve(ns.host, ns.port))
        return 0
    duration = min(max(ns.duration, 0.1), 600.0)  # bounded, whatever was asked
    results = asyncio.run(drive(ns.url, ns.rate, duration, ns.concurrency))
    summary = report(results, ns.rate, ns.json)
    return 0 if summary["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
