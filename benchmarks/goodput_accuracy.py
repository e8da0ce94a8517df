"""Goodput accounting error against the workers' own timestamps.

    python benchmarks/goodput_accuracy.py [--runs 10] [--json FILE]

Each run is a real supervisor (``python -m supervisor run``, 2 ranks, one restart allowed)
over ``tests/workers/goodput_worker.py``: the ranks sleep 0.8 s (their start-up), then post
a deadline every 50 ms, logging the wall time right before each post; rank 1 fails after
3 posts in the first attempt, by exiting (``crash``: it logs the time right before
``os._exit``) or by going silent until its 0.5 s deadline expires (``hang``). The
supervisor's ``recovered`` event is compared with the workers' view of the same moments:

- failure: ``failed_at`` vs the crash time, or (hang) the rank's last post;
- resumed: ``resumed_at`` vs the latest first post of the ranks of the next attempt;
- lost: ``lost`` vs the difference of the two workers' times.

Error = supervisor - workers (positive: the supervisor saw it later). The phases between
(noticed, stopped, launched) have no worker-side counterpart: a worker cannot see its
own death being noticed. Prints a Markdown table of median and max |error| per boundary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.harness import REPO, log

WORKER = REPO / "tests" / "workers" / "goodput_worker.py"
MODES = {
    "crash": ["--mode", "exit"],
    "hang": ["--mode", "hang", "--deadline", "0.5"],
}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def one_run(mode: str, tmp: Path) -> dict[str, float]:
    events, wlog = tmp / "events.jsonl", tmp / "workers.jsonl"
    cmd = [sys.executable, "-m", "supervisor", "run", "--health-port", "0",
           "--nproc-per-node", "2", "--max-restarts", "1", "--shutdown-timeout", "2",
           "--log-dir", str(tmp / "logs"), "--event-log", str(events), str(WORKER),
           "--log", str(wlog), "--startup", "0.8", "--steps", "10", "--fail-rank", "1",
           "--posts", "3", *MODES[mode]]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run(cmd, env=env, check=True, timeout=120, capture_output=True)
    (rec,) = [e for e in read_jsonl(events) if e["event"] == "recovered"]
    log = read_jsonl(wlog)
    if mode == "crash":
        failed = next(w["t"] for w in log if w["event"] == "exit")
    else:
        failed = max(w["t"] for w in log if w["rank"] == 1 and w["attempt"] == 0)
    firsts: dict[int, float] = {}
    for w in log:
        if w["event"] == "post" and w["attempt"] == 1:
            firsts.setdefault(w["rank"], w["t"])
    resumed = max(firsts.values())
    return {
        "failure": rec["failed_at"] - failed,
        "resumed": rec["resumed_at"] - resumed,
        "lost": rec["lost"] - (resumed - failed),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10, help="runs per mode")
    p.add_argument("--json", type=Path, default=None, help="write the raw errors here")
    args = p.parse_args()
    results: dict[str, list[dict[str, float]]] = {}
    for mode in MODES:
        results[mode] = []
        for i in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="bench-goodput-") as tmp:
                results[mode].append(one_run(mode, Path(tmp)))
            log(f"{mode} run {i + 1}/{args.runs}: {results[mode][-1]}")
    print("| scenario | boundary | median error (ms) | max abs error (ms) |")
    print("|---|---|---:|---:|")
    for mode, runs in results.items():
        for key in ("failure", "resumed", "lost"):
            errors = [r[key] * 1000 for r in runs]
            print(f"| {mode} | {key} | {statistics.median(errors):.2f} | "
                  f"{max(abs(e) for e in errors):.2f} |")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
