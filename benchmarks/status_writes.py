"""etcd writes per node per hour at idle, for the job-wide status view (issue 20: <= 60).

    python benchmarks/status_writes.py [--nodes 2] [--window 60]

Starts a real etcd and NODES real supervisors (``--rdzv-backend etcd``, 2 ranks each, the
ranks posting a deadline every 0.2 s forever: a healthy, progressing job). Once every
node's summary shows it running and productive, it reads each summary key's etcd
``version`` (one per put) and the store's revision, waits WINDOW seconds, and reads them
again. Reports summary puts per node per hour, and all writes to the store per hour (the
rendezvous' own included; lease keep-alives are not writes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.harness import REPO
from supervisor.rendezvous.etcd.summary import summary_prefix
from tests.support.etcd import etcd_factory


def etcd_range(endpoint: str, prefix: str) -> tuple[list[dict[str, Any]], int]:
    import base64

    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    body = json.dumps({"key": b64(prefix), "range_end": b64(end)}).encode()
    with urllib.request.urlopen(f"{endpoint}/v3/kv/range", body, timeout=5) as resp:
        data = json.load(resp)
    kvs = [{"key": base64.b64decode(kv["key"]).decode(), "version": int(kv["version"]),
            "value": json.loads(base64.b64decode(kv["value"]))} for kv in data.get("kvs", [])]
    return kvs, int(data["header"]["revision"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--window", type=float, default=60.0, help="idle seconds measured")
    args = p.parse_args()
    run_id = f"bench-status-{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="bench-status-") as tmp, \
            etcd_factory(Path(tmp)) as factory:
        member = factory.single()
        procs = []
        try:
            for i in range(args.nodes):
                cmd = [sys.executable, "-m", "supervisor", "run", "--rdzv-backend", "etcd",
                       "--rdzv-endpoint", member.endpoint, "--rdzv-id", run_id,
                       "--nnodes", f"{args.nodes}:{args.nodes}", "--nproc-per-node", "2",
                       "--health-port", "0", "--log-dir", f"{tmp}/n{i}",
                       str(REPO / "tests" / "workers" / "goodput_worker.py"),
                       "--log", f"{tmp}/w{i}.jsonl", "--interval", "0.2",
                       "--steps", "100000000"]
                procs.append(subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(REPO)},
                                              stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL))
            prefix = summary_prefix(run_id)
            deadline = time.monotonic() + 60
            while True:
                kvs, _ = etcd_range(member.endpoint, prefix)
                settled = [kv for kv in kvs if kv["value"]["state"] == "running"
                           and (kv["value"].get("goodput") or {}).get("segment") == "productive"]
                if len(settled) == args.nodes:
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"nodes did not settle: {kvs}")
                time.sleep(0.5)
            before, rev0 = etcd_range(member.endpoint, prefix)
            time.sleep(args.window)  # the idle window being measured
            after, rev1 = etcd_range(member.endpoint, prefix)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(30)
    puts = sum(a["version"] for a in after) - sum(b["version"] for b in before)
    hour = 3600 / args.window
    print("| nodes | idle window (s) | summary puts/node/hour | all etcd writes/node/hour |")
    print("|---:|---:|---:|---:|")
    print(f"| {args.nodes} | {args.window:.0f} | {puts * hour / args.nodes:.1f} | "
          f"{(rev1 - rev0) * hour / args.nodes:.1f} |")
    print(f"(summary puts while settling: {sum(b['version'] for b in before)})", file=sys.stderr)


if __name__ == "__main__":
    main()
