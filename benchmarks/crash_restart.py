"""Crash -> first restarted worker running, elastic-supervisor vs torchrun, side by side.

    python benchmarks/crash_restart.py [--restarts 30] [--runs 2] [--workers 4] [--no-fast]

Scenario (the same for every launcher): WORKERS workers, ``--max-restarts RESTARTS``. On
each attempt below RESTARTS, rank 0 waits until all ranks are up, waits a random 20-120 ms,
records ``time.monotonic()`` and exits 1; the launcher must stop the other ranks and start
the next attempt. Latency = earliest first-line time of any worker of the next attempt -
the crash time. Also reported: crash -> last worker of the next attempt up (the whole group
running). One run gives RESTARTS samples; runs alternate the launchers' order.

Also measured: the launcher's own CPU time per restart (launcher + helpers, from the first
group up to the last group up, divided by RESTARTS). Unlike latency this hardly depends
on how busy the machine is, so it shows what each restart costs the launcher.

torchrun polls its workers every ``--monitor-interval`` (default 0.1 s), so its figure is
reported with the default (what users get) and, unless ``--no-fast``, with 0.01 s.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import psutil

from benchmarks.harness import (
    OURS,
    TORCHRUN,
    TORCHRUN_FAST,
    BenchError,
    Job,
    Launcher,
    Summary,
    alternate,
    job,
    sched_seconds,
)

# Our supervisor's event log splits each restart into phases (monotonic clock, comparable
# with the workers' records): crash -> exit noticed -> group stopped -> first worker of the
# next group on its first line. "spawn_all" (group stopped -> every worker of the next
# group spawned) overlaps the last phase: the first worker starts while the rest are spawned.
PHASES = ("detect", "stop", "first_line", "spawn_all")


@dataclass(frozen=True)
class CrashResult:
    launcher: str
    first_up: Summary  # seconds, crash -> first worker of the next attempt up
    all_up: Summary  # seconds, crash -> every worker of the next attempt up
    samples: list[float]
    cpu_per_restart: Summary  # seconds of launcher (+ helpers) CPU per restart, CPU clock
    phases: dict[str, Summary] | None = None  # ours only: medians of each phase


Latencies = tuple[list[float], list[float], dict[str, list[float]], float]


def run_once(launcher: Launcher, restarts: int, workers: int) -> Latencies:
    """One job with ``restarts`` crashes: (first-up, all-up) latencies in seconds, phases,
    launcher CPU seconds per restart."""
    with job(launcher, mode="crash", nproc=workers, max_restarts=restarts, crashes=restarts) as j:
        j.start()
        j.wait_up(0, workers, timeout=120.0)
        procs = [psutil.Process(j.pid), *j.helpers(0)]
        cpu0 = {p.pid: sched_seconds([p]) for p in procs}
        j.wait_up(restarts, workers, timeout=60.0 + 5.0 * restarts, poll=0.05)
        cpu1 = {p.pid: sched_seconds([p]) for p in procs}
        rc = j.wait(timeout=60.0)
        if rc != 0:
            raise BenchError(f"{launcher.name} exited {rc}: {j.tail()}")
        # our standbys (pre-started interpreters, see docs/design.md) become later attempts'
        # workers under the same pid: their start-up is a worker's, as torchrun's workers'
        # start-up is, so any pid that ever ran a worker is left out of the launcher's CPU
        ran_worker = {pid for r in range(restarts + 1) for pid in j.worker_pids(r)}
        cpu = sum(cpu1[p] - cpu0[p] for p in cpu0 if p not in ran_worker) / restarts
        first, every = [], []
        for r in range(restarts):
            crash = j.crash_time(r)
            ups = j.up_times(r + 1)
            if len(ups) != workers:
                raise BenchError(f"{launcher.name}: attempt {r + 1} has {len(ups)} records")
            first.append(min(ups) - crash)
            every.append(max(ups) - crash)
        phases = _phases(j, restarts) if launcher.kind == "ours" else {}
        return first, every, phases, cpu


def _phases(j: Job, restarts: int) -> dict[str, list[float]]:
    """Split each of our restarts into phases using the supervisor's events.jsonl."""
    logs = list((j.root / "logs").glob("*/events.jsonl"))
    if len(logs) != 1:
        return {}
    exited: dict[int, float] = {}
    stopped: dict[int, float] = {}
    started: dict[int, float] = {}
    for line in logs[0].read_text().splitlines():
        ev = json.loads(line)
        attempt, kind = ev.get("attempt"), ev.get("event")
        if kind == "worker_exited" and ev.get("exit_code") == 1:
            exited.setdefault(attempt, ev["mono"])
        elif kind == "group_stopped":
            stopped[attempt] = ev["mono"]
        elif kind == "group_started":
            started[attempt] = ev["mono"]
    out: dict[str, list[float]] = {name: [] for name in PHASES}
    for r in range(restarts):
        a = r  # attempt K is attempt_K: in a fresh log directory, restart count r runs attempt r
        if a not in exited or a not in stopped or a + 1 not in started:
            continue
        crash, up = j.crash_time(r), min(j.up_times(r + 1))
        out["detect"].append(exited[a] - crash)
        out["stop"].append(stopped[a] - exited[a])
        out["first_line"].append(up - stopped[a])
        out["spawn_all"].append(started[a + 1] - stopped[a])
    return out


def measure(
    launchers: list[Launcher], *, restarts: int, runs: int, workers: int, log=print
) -> list[CrashResult]:
    first: dict[str, list[float]] = {lc.name: [] for lc in launchers}
    every: dict[str, list[float]] = {lc.name: [] for lc in launchers}
    phases: dict[str, dict[str, list[float]]] = {
        lc.name: {n: [] for n in PHASES} for lc in launchers
    }
    cpu: dict[str, list[float]] = {lc.name: [] for lc in launchers}
    for rep in range(runs):
        for launcher in alternate(launchers, rep):
            f, e, ph, c = run_once(launcher, restarts, workers)
            first[launcher.name] += f
            every[launcher.name] += e
            cpu[launcher.name].append(c)
            for name, values in ph.items():
                phases[launcher.name][name] += values
            s = Summary.of(f)
            log(f"  crash run {rep + 1}/{runs} {launcher.name}: median {s.median * 1e3:.1f} ms "
                f"[{s.low * 1e3:.1f}-{s.high * 1e3:.1f}], CPU {c * 1e3:.1f} ms/restart")
    return [
        CrashResult(
            lc.name, Summary.of(first[lc.name]), Summary.of(every[lc.name]), first[lc.name],
            Summary.of(cpu[lc.name]),
            {n: Summary.of(v) for n, v in phases[lc.name].items() if v} or None,
        )
        for lc in launchers
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--restarts", type=int, default=30)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--no-fast", action="store_true", help="skip torchrun --monitor-interval 0.01")
    ns = p.parse_args(argv)
    launchers = [OURS, TORCHRUN] + ([] if ns.no_fast else [TORCHRUN_FAST])
    results = measure(launchers, restarts=ns.restarts, runs=ns.runs, workers=ns.workers)
    print(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
