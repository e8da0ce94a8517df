"""Memory and idle CPU of the launcher, elastic-supervisor vs torchrun, side by side.

    python benchmarks/idle_footprint.py [--workers 8] [--window 20] [--settle 3] [--reps 1]

Scenario: WORKERS workers that record their first line and sleep. Once all are up and
SETTLE seconds have passed, we read each launcher's RSS (and USS, the memory only it
holds) and then its CPU time (user + system, psutil) over a WINDOW-second window.
"Launcher" is the process we spawned: the supervisor, or torchrun's agent. "+ helpers"
adds every descendant that is not a worker: our guardian (a small ``python -S`` child
that kills worker process groups if the supervisor dies); torchrun has none here. The
``setpriv`` wrappers exec into the workers, so they are not separate processes.
CPU is also read from each process's CPU-time clock (``clock_getcpuclockid``: every
thread, exited ones included, ns resolution), since an idle supervisor may use less than
psutil's 10 ms clock tick.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

import psutil

from benchmarks.harness import (
    OURS,
    TORCHRUN,
    BenchError,
    Launcher,
    Summary,
    alternate,
    cpu_seconds,
    job,
    rss_bytes,
    sched_seconds,
    uss_bytes,
)
from supervisor.workers.warm.standby import is_standby_command


@dataclass(frozen=True)
class Footprint:
    launcher: str
    helpers: list[str]  # command names of the non-worker descendants
    rss: Summary  # bytes, the launcher process
    rss_all: Summary  # bytes, launcher + helpers
    uss: Summary
    uss_all: Summary
    cpu: Summary  # seconds of CPU over the window, the launcher (psutil)
    cpu_all: Summary  # launcher + helpers (psutil)
    sched: Summary  # seconds, launcher (CPU clock, all threads)
    sched_all: Summary
    window: float


def run_once(launcher: Launcher, workers: int, window: float, settle: float) -> dict[str, object]:
    with job(launcher, mode="idle", nproc=workers) as j:
        j.start()
        j.wait_up(0, workers, timeout=120.0)
        time.sleep(settle)
        if not j.running():
            raise BenchError(f"{launcher.name} exited early: {j.tail()}")
        me = [psutil.Process(j.pid)]
        helpers = j.helpers(0)
        both = me + helpers
        sample = {
            "helpers": sorted(_describe(p) for p in helpers),
            "rss": rss_bytes(me), "rss_all": rss_bytes(both),
            "uss": uss_bytes(me), "uss_all": uss_bytes(both),
        }
        c0, ca0 = cpu_seconds(me), cpu_seconds(both)
        s0, sa0 = sched_seconds(me), sched_seconds(both)
        t0 = time.monotonic()
        time.sleep(window)
        elapsed = time.monotonic() - t0
        if not j.running():
            raise BenchError(f"{launcher.name} exited during the window: {j.tail()}")
        sample |= {
            "cpu": cpu_seconds(me) - c0, "cpu_all": cpu_seconds(both) - ca0,
            "sched": sched_seconds(me) - s0, "sched_all": sched_seconds(both) - sa0,
            "window": elapsed,
        }
        return sample


def standby_cost(workers: int, settle: float) -> dict[str, float]:
    """Ours with ``--max-restarts 1``: a standby interpreter per local rank waits for the next
    attempt (docs/design.md). Their memory, in bytes, and how many there are."""
    with job(OURS, mode="idle", nproc=workers, max_restarts=1) as j:
        j.start()
        j.wait_up(0, workers, timeout=120.0)
        time.sleep(settle)
        standbys = [p for p in j.helpers(0) if is_standby_command(_cmdline(p))]
        me = [psutil.Process(j.pid)]
        return {"count": len(standbys), "rss": rss_bytes(standbys), "uss": uss_bytes(standbys),
                "supervisor_rss": rss_bytes(me)}


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _describe(p: psutil.Process) -> str:
    try:
        cmd = p.cmdline()
    except psutil.Error:
        return "?"
    return " ".join(cmd[:3]) + (" ..." if len(cmd) > 3 else "")


def measure(
    launchers: list[Launcher], *, workers: int, window: float, settle: float, reps: int, log=print
) -> list[Footprint]:
    samples: dict[str, list[dict[str, object]]] = {lc.name: [] for lc in launchers}
    for rep in range(reps):
        for launcher in alternate(launchers, rep):
            s = run_once(launcher, workers, window, settle)
            samples[launcher.name].append(s)
            log(f"  idle rep {rep + 1}/{reps} {launcher.name}: RSS {s['rss'] / 2**20:.1f} MiB "
                f"(+helpers {s['rss_all'] / 2**20:.1f}), CPU {s['cpu']:.3f} s "
                f"(+helpers {s['cpu_all']:.3f}) in {s['window']:.1f} s")
    results = []
    for lc in launchers:
        ss = samples[lc.name]

        def of(key: str, ss: list[dict[str, object]] = ss) -> Summary:
            return Summary.of([float(s[key]) for s in ss])  # type: ignore[arg-type]

        results.append(Footprint(
            lc.name, list(ss[0]["helpers"]),  # type: ignore[call-overload]
            of("rss"), of("rss_all"), of("uss"), of("uss_all"),
            of("cpu"), of("cpu_all"), of("sched"), of("sched_all"), window,
        ))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--window", type=float, default=20.0)
    p.add_argument("--settle", type=float, default=3.0)
    p.add_argument("--reps", type=int, default=1)
    ns = p.parse_args(argv)
    results = measure([OURS, TORCHRUN], workers=ns.workers, window=ns.window,
                      settle=ns.settle, reps=ns.reps)
    print(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
