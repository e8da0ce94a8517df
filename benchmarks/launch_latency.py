"""Launch -> first worker's first line, elastic-supervisor vs torchrun, side by side.

    python benchmarks/launch_latency.py [--reps 10] [--workers 4]

t0 is taken just before the launcher process is spawned; each worker records
``time.monotonic()`` on its first line and exits 0. Reported: t0 -> earliest first line,
and t0 -> the launcher's exit (the whole job: start-up, 4 workers, teardown). Repetitions
alternate the launchers' order. A reference row spawns the same workers with no launcher
at all (``Popen`` x WORKERS from this process): the floor set by the worker interpreter's
own start-up on this machine at this moment.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.harness import (
    OURS,
    TORCHRUN,
    WORKER,
    BenchError,
    Job,
    Launcher,
    Summary,
    alternate,
    job,
)


@dataclass(frozen=True)
class LaunchResult:
    launcher: str
    first_line: Summary  # seconds, spawn -> first worker's first line
    job_exit: Summary | None  # seconds, spawn -> launcher exited (None for the floor)
    phases: dict[str, Summary] | None = None  # ours only, from events.jsonl


# Our supervisor's start-up, split by its event log (monotonic clock): spawn -> its first
# event (interpreter, imports, set-up) -> first worker's first line. "spawn_all" (first
# event -> every worker spawned) overlaps the last phase.
PHASES = ("startup", "first_line", "spawn_all")


def run_once(launcher: Launcher, workers: int) -> tuple[float, float, dict[str, float]]:
    with job(launcher, mode="exit", nproc=workers) as j:
        j.start()
        rc = j.wait(timeout=120.0)
        if rc != 0:
            raise BenchError(f"{launcher.name} exited {rc}: {j.tail()}")
        ups = j.up_times(0)
        if len(ups) != workers:
            raise BenchError(f"{launcher.name}: {len(ups)} of {workers} workers recorded")
        assert j.t_exit is not None
        phases = _phases(j, min(ups)) if launcher.kind == "ours" else {}
        return min(ups) - j.t_spawn, j.t_exit - j.t_spawn, phases


def _phases(j: Job, first_up: float) -> dict[str, float]:
    logs = list((j.root / "logs").glob("*/events.jsonl"))
    if len(logs) != 1:
        return {}
    marks: dict[str, float] = {}
    for line in logs[0].read_text().splitlines():
        ev = json.loads(line)
        if ev.get("event") in ("supervisor_started", "group_started"):
            marks.setdefault(ev["event"], ev["mono"])
    if len(marks) != 2:
        return {}
    return {
        "startup": marks["supervisor_started"] - j.t_spawn,
        "first_line": first_up - marks["supervisor_started"],
        "spawn_all": marks["group_started"] - marks["supervisor_started"],
    }


def bare_first_line(workers: int) -> float:
    """No launcher: spawn the workers from here; spawn of the first -> earliest first line."""
    with tempfile.TemporaryDirectory(prefix="bench-bare-") as tmp:
        procs: list[subprocess.Popen[bytes]] = []
        try:
            t0 = time.monotonic()
            for rank in range(workers):
                env = dict(os.environ, LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(workers),
                           TORCHELASTIC_RESTART_COUNT="0", OMP_NUM_THREADS="1")
                procs.append(subprocess.Popen(
                    [sys.executable, "-u", str(WORKER), "exit", tmp], env=env,
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, cwd=tmp,
                ))
            for p in procs:
                p.wait(timeout=60)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        ups = [float(f.read_text().split()[0]) for f in Path(tmp).glob("up_0_*")]
        if len(ups) != workers:
            raise BenchError(f"bare launch: {len(ups)} of {workers} workers recorded")
        return min(ups) - t0


def measure(launchers: list[Launcher], *, reps: int, workers: int, log=print) -> list[LaunchResult]:
    first: dict[str, list[float]] = {lc.name: [] for lc in launchers}
    total: dict[str, list[float]] = {lc.name: [] for lc in launchers}
    bare: list[float] = []
    phases: dict[str, dict[str, list[float]]] = {
        lc.name: {n: [] for n in PHASES} for lc in launchers
    }
    for rep in range(reps):
        bare.append(bare_first_line(workers))
        for launcher in alternate(launchers, rep):
            f, t, ph = run_once(launcher, workers)
            first[launcher.name].append(f)
            total[launcher.name].append(t)
            for name, value in ph.items():
                phases[launcher.name][name].append(value)
        log(f"  launch rep {rep + 1}/{reps}: "
            + ", ".join(f"{n} {first[n][-1] * 1e3:.0f} ms" for n in first)
            + f", no launcher {bare[-1] * 1e3:.0f} ms")
    results = [
        LaunchResult(
            lc.name, Summary.of(first[lc.name]), Summary.of(total[lc.name]),
            {n: Summary.of(v) for n, v in phases[lc.name].items() if v} or None,
        )
        for lc in launchers
    ]
    results.append(LaunchResult("no launcher", Summary.of(bare), None))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--workers", type=int, default=4)
    ns = p.parse_args(argv)
    results = measure([OURS, TORCHRUN], reps=ns.reps, workers=ns.workers)
    print(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
