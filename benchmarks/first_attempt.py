"""Does a first attempt forked from the fork server start training sooner? In one run.

Two nodes of 2 ranks each (``healing_job.py``: torch, gloo, an all-reduce every 50 ms)
on a real etcd; the rendezvous waits before its first round, so that a fork server
started with the supervisor has imported torch by then:

- ``last call``: both nodes start together, ``--nnodes 2:3`` with ``last_call_timeout``
  ``--wait`` s (an elastic job that waits for a third node that never comes);
- ``late node``: n0 starts, n1 only ``--wait`` s later (``--nnodes 2``): n1's fork server
  cannot be ready, and every step is a collective, so the job waits for n1's cold ranks.

For each: ours cold (no ``--preload``), ours ``--preload torch`` (the first attempt waits
for the fork server's import and runs in interpreters forked from it), and torchrun (c10d,
same ``--nnodes`` and ``last_call_timeout``) in the same run. Reported: the time from the
round's completion (our ``group_started``; for torchrun, the last node's start plus the
same wait, i.e. when its round can close) to the first all-reduce done on every rank; and
for ours, each node's launch → its ranks' first step.
``python benchmarks/first_attempt.py [--reps 3] [--wait 15]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.healing import BIN, JOB, LOCAL, Nodes, etcd_server, free_port, records, wait_until


def launches(root: Path, name: str) -> list[float]:
    """Wall times of the node's ``group_started`` events."""
    found = []
    for path in (root / name).glob("*/events.jsonl"):
        for line in path.read_text().splitlines():
            doc = json.loads(line)
            if doc.get("event") == "group_started":
                found.append(float(doc["time"]))
    return sorted(found)


def run_case(scenario: str, launcher: str, wait: float) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="first-bench-"))
    log, gate = root / "steps.jsonl", root / "never"
    nodes = Nodes(root)
    nnodes = "2:3" if scenario == "last call" else "2"
    last_call = round(wait) if scenario == "last call" else 1  # torchrun wants an integer
    try:
        with etcd_server(root) as etcd:
            run_id = f"fa-{os.getpid()}-{int(time.time() * 1000) % 10**8}"
            c10d = f"127.0.0.1:{free_port()}"

            def argv(name: str) -> list[str]:
                job = [str(JOB), "--record-to", str(log), "--bad-gate", str(gate)]
                if launcher == "torchrun":
                    return [str(BIN / "torchrun"), "--rdzv-backend", "c10d",
                            "--rdzv-endpoint", c10d, "--rdzv-id", run_id, "--nnodes", nnodes,
                            "--nproc-per-node", str(LOCAL), "--rdzv-conf",
                            f"last_call_timeout={last_call:g}", "--max-restarts", "0",
                            "--log-dir", str(root / name), *job]
                preload = ["--preload", "torch"] if launcher == "forked" else []
                return [str(BIN / "elastic-supervisor"), "run", "--rdzv-backend", "etcd",
                        "--rdzv-endpoint", etcd, "--rdzv-id", run_id, "--nnodes", nnodes,
                        "--nproc-per-node", str(LOCAL), "--rdzv-conf",
                        f"node_id={name},last_call_timeout={last_call:g},lease_ttl=5",
                        "--health-port", "0", "--log-dir", str(root / name),
                        *preload, *job]

            started = time.time()
            nodes.start("n0", argv("n0"), bad=False)
            if scenario == "late node":
                time.sleep(wait)
            last_start = time.time()
            nodes.start("n1", argv("n1"), bad=False)

            def all_first() -> list[dict[str, Any]] | None:
                if all(proc.poll() is not None for proc in nodes.procs.values()):
                    raise TimeoutError("every launcher exited before every rank's first step")
                firsts = [r for r in records(log) if r["event"] == "first"]
                return firsts if len({r["rank"] for r in firsts}) == 2 * LOCAL else None

            firsts = wait_until("every rank's first step", all_first, 240)
            done = max(r["t"] for r in firsts)
            if launcher == "torchrun":
                closes = last_start + (wait if scenario == "last call" else 0.0)
                result: dict[str, Any] = {"round_to_all_first": done - closes}
            else:
                round_at = min(launches(root, "n0")[0], launches(root, "n1")[0])
                result = {"round_to_all_first": done - round_at}
                for name in ("n0", "n1"):
                    mine = [r["t"] for r in firsts if r["node"] == name]
                    result[f"{name}_launch_to_first"] = max(mine) - launches(root, name)[0]
            result["start_to_all_first"] = done - started
    finally:
        nodes.stop()
        shutil.rmtree(root, ignore_errors=True)
    return result


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--wait", type=float, default=15.0,
                   help="s the first round waits (last call, or the late node's delay)")
    args = p.parse_args()
    rows = []
    for scenario in ("last call", "late node"):
        for launcher in ("cold", "forked", "torchrun"):
            reps: list[dict[str, Any]] = []
            for _ in range(args.reps):
                try:
                    reps.append(run_case(scenario, launcher, args.wait))
                except TimeoutError as exc:
                    print(json.dumps({"scenario": scenario, "launcher": launcher,
                                      "error": str(exc)}), file=sys.stderr, flush=True)
                    continue
                print(json.dumps({"scenario": scenario, "launcher": launcher, **reps[-1]}),
                      file=sys.stderr, flush=True)
            keys = sorted({k for r in reps for k in r})
            row: dict[str, Any] = {"scenario": scenario, "launcher": launcher,
                                   "runs": len(reps)}
            for key in keys:
                row[key] = median([r[key] for r in reps if key in r])
            rows.append(row)
    print("| scenario | launcher | runs | round → every rank's first step (median) | "
          "n0 launch → first step | n1 launch → first step |")
    print("|---|---|---|---|---|---|")

    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.2f} s"
    for r in rows:
        print(f"| {r['scenario']} | {r['launcher']} | {r['runs']} | "
              f"{f(r.get('round_to_all_first'))} | {f(r.get('n0_launch_to_first'))} | "
              f"{f(r.get('n1_launch_to_first'))} |")


if __name__ == "__main__":
    main()
