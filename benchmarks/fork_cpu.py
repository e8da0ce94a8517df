"""CPU spent on forked standbys per attempt (issue 29's "standby CPU per attempt").

    python -m benchmarks.fork_cpu [--ranks 2,4,8] [--attempts 8] [--preload torch,torch._dynamo]

One supervisor per rank count with ``--preload``: each attempt's workers run ``--hold``
seconds, then local rank 0 exits 1 and the group restarts, ``--attempts`` times. After
each launch the node's fork server forks one standby per rank for the next attempt: a
double fork (server -> intermediate child -> standby, which the supervisor adopts). What
that costs is the fork server's CPU (every thread, ns clock) plus its reaped intermediate
children's (``cutime + cstime``, clock ticks), sampled ``--hold``/2 s into attempts 1 and
N - 1 (the forks of an attempt are done by then) and divided by the attempts between.
Not in it: the standby's own CPU after the fork (reseeding, waiting for its hand-off: under
one clock tick each in the probe of docs/benchmarks.md), and what the worker pays later
for copy-on-write faults on the pages it writes, which a cold worker pays as its imports.

The machine's own ``import torch`` time is printed next to the figures.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks.harness import BIN, BenchError, ensure_bytecode, launcher_env, log, sched_seconds
from tests.support.eventlog import read_events

READY = re.compile(r"fork server \(pid (\d+)\) ready")


def worker(hold: float) -> int:
    """The job: hold, then local rank 0 fails (every attempt)."""
    time.sleep(hold)
    return 1 if os.environ["LOCAL_RANK"] == "0" else 0


def spent(server: psutil.Process) -> float:
    """The fork server's CPU (ns clock, all its threads) + its reaped children's (ticks)."""
    children = server.cpu_times()  # children_user, children_system: the reaped ones
    return sched_seconds([server]) + children.children_user + children.children_system


def one(ranks: int, attempts: int, hold: float, preload: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="fork-cpu-") as tmp:
        root = Path(tmp)
        events = root / "events.jsonl"
        argv = [str(BIN / "elastic-supervisor"), "run", "--nproc-per-node", str(ranks),
                "--max-restarts", str(attempts), "--preload", preload, "--health-port", "0",
                "--log-dir", str(root / "logs"), "--event-log", str(events),
                str(Path(__file__).resolve()), "--worker", str(hold)]
        err = (root / "err").open("wb")
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err,
                                env=launcher_env(), cwd=root, start_new_session=True)
        try:
            samples: dict[int, float] = {}
            server = 0
            deadline = time.monotonic() + 120 + attempts * (hold + 10)
            while len(samples) < 2:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise BenchError(f"{ranks} ranks: the run ended or stalled: "
                                     f"{(root / 'err').read_text()[-2000:]}")
                if not server and (m := READY.search((root / "err").read_text())):
                    server = int(m.group(1))
                started = [e["mono"] for e in read_events(events, "group_started")]
                for attempt in (1, attempts - 1):
                    if attempt in samples or len(started) <= attempt:
                        continue
                    if time.monotonic() >= started[attempt] + hold / 2 and server:
                        samples[attempt] = spent(psutil.Process(server))
                time.sleep(0.05)
            per = (samples[attempts - 1] - samples[1]) / (attempts - 2)
            rss = psutil.Process(server).memory_info().rss
        finally:
            proc.terminate()
            proc.wait(60)
            err.close()
    return {"ranks": ranks, "cpu_per_attempt_ms": per * 1e3,
            "cpu_per_standby_ms": per * 1e3 / ranks, "server_rss_mib": rss / 2**20}


def import_seconds(module: str) -> float:
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    return float(done.stdout)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        return worker(float(sys.argv[2]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2,4,8")
    p.add_argument("--attempts", type=int, default=8)
    p.add_argument("--hold", type=float, default=3.0, help="seconds each attempt runs")
    p.add_argument("--preload", default="torch,torch._dynamo")
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args()
    if args.attempts < 4:
        p.error("--attempts must be at least 4")
    ensure_bytecode()
    first = args.preload.split(",")[0]
    log(f"import {first} alone: {import_seconds(first):.2f} s on this machine")
    print(f"| ranks | CPU per attempt, ms (median of {args.reps}) | per standby, ms | "
          "fork server RSS, MiB |")
    print("|---|---|---|---|")
    for ranks in (int(r) for r in args.ranks.split(",")):
        runs = []
        for rep in range(args.reps):
            runs.append(one(ranks, args.attempts, args.hold, args.preload))
            log(f"{ranks} ranks, run {rep + 1}: {runs[-1]}")
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        spread = [round(r["cpu_per_attempt_ms"], 1) for r in runs]
        print(f"| {ranks} | {med['cpu_per_attempt_ms']:.1f} {spread} | "
              f"{med['cpu_per_standby_ms']:.1f} | {med['server_rss_mib']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
