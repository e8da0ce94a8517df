"""Health endpoint latency under load, and restart latency with and without that load.

A real supervisor runs 8 workers that stream output through ``--tee 3`` (each prints
``--line-rate`` lines/s, console to a file). Rank 0 crashes every ``--crash-every`` seconds
and the group restarts; its replacement records when it came up. Two runs:

1. unloaded: restarts only -> crash -> restarted-rank-0 latency;
2. loaded: the same, while ``/healthz`` gets ``--rate`` requests/s (open loop, see
   health_load.py) -> HTTP p50/p99/errors and the restart latency under load.

Each run also reports the machine's CPU busy share over its window (all cores: workers,
supervisor and load client together), to tell a saturated machine from a latency tail,
the share the host stole from those CPUs (a virtual machine's vCPU not running), and how
long the supervisor's event-loop thread waited for a CPU while runnable (its schedstat):
what a run with an outlying tail was up against.

Targets (issue 5): p99 <= 10 ms, 0 errors, loaded restart latency within 1.5x unloaded.
torchrun has no health server (its health check is a stub), so there is no torchrun
column here. The load client runs on the same 2 cores as the supervisor and its workers;
with ``--supervisor-cgroup DIR`` (root) the supervisor and its workers run in that cgroup and
the client outside it: a CPU-limited cgroup then stands in for a slower node probed from
elsewhere (a pessimistic one: when the cgroup's quota runs out, everything in it waits,
whatever its priority, also for work at idle priority such as a fork server's import).
``--supervisor-cpus 1 --client-cpus 0`` does the same without root and without a quota: the
supervisor and its workers get CPU 1 only (an affinity every child inherits), the client CPU 0
only, so a node with half this machine's CPUs is probed from a CPU it does not share. CPU busy
is then reported for the supervisor's CPUs alone, which is what saturates first.

    python benchmarks/health_under_load.py --duration 20
    python benchmarks/health_under_load.py --supervisor-cpus 1 --client-cpus 0 --rate 500
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from benchmarks.harness import stop_session
from benchmarks.health_load import drive, report

WORKER = r"""
import os, sys, time
out, line_rate, crash_every = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
rank = int(os.environ["RANK"]); restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if rank == 0:
    with open(os.path.join(out, f"up_{restart}"), "w") as f:
        f.write(repr(time.monotonic()))
start = time.monotonic()
i = 0
while True:
    i += 1
    sys.stdout.write(f"rank {rank} restart {restart} line {i} " + "x" * 60 + "\n")
    sys.stdout.flush()
    if rank == 0 and time.monotonic() - start >= crash_every:
        with open(os.path.join(out, f"crash_{restart}"), "w") as f:
            f.write(repr(time.monotonic()))
        os._exit(1)
    time.sleep(1.0 / line_rate)
"""


def start_supervisor(
    base: Path, args: argparse.Namespace, crash_every: float
) -> tuple[subprocess.Popen[bytes], int]:
    out = base / "out"
    out.mkdir()
    (base / "worker.py").write_text(WORKER)
    console = open(base / "console.log", "wb")  # noqa: SIM115 - the child owns it
    stderr = open(base / "supervisor.log", "wb")  # noqa: SIM115
    cmd = [sys.executable, "-m", "supervisor", "run", "--health-port", "0",
           "--nproc-per-node", "8", "--tee", "3", "--max-restarts", "1000",
           "--log-dir", str(base / "logs"), *args.supervisor_flags.split(),
           str(base / "worker.py"), str(out),
           str(args.line_rate), str(crash_every)]
    cgroup = args.supervisor_cgroup

    cpus = args.supervisor_cpus

    def confine() -> None:  # in the child before exec: every worker inherits both
        if cgroup:
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))
        if cpus:
            os.sched_setaffinity(0, cpus)

    proc = subprocess.Popen(cmd, stdout=console, stderr=stderr, start_new_session=True,
                            preexec_fn=confine if cgroup or cpus else None)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        log = (base / "supervisor.log").read_bytes()
        m = re.search(rb"health endpoint on http://[^:]+:(\d+)", log)
        if m:
            return proc, int(m.group(1))
        time.sleep(0.01)
    proc.kill()
    raise RuntimeError("the supervisor did not report its health port")


def wait_serving(port: int, settle: float) -> None:
    """Steady state only: the server answers (it starts after the first launch), then the
    workers' start-up burst settles."""
    import urllib.request

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.02)
    time.sleep(settle)


def restart_latencies(out: Path) -> list[float]:
    """crash_R -> up_{R+1}, in ms, for every completed restart."""
    result = []
    for crash in sorted(out.glob("crash_*")):
        r = int(crash.name.split("_")[1])
        up = out / f"up_{r + 1}"
        if up.exists():
            result.append((float(up.read_text()) - float(crash.read_text())) * 1e3)
    return result


def cpu_shares(before: list[Any], after: list[Any], cpus: set[int] | None) -> tuple[float, float]:
    """Between two ``psutil.cpu_times(percpu=True)``, over ``cpus`` (all when None): the
    share of CPU time not idle (how close the load comes to saturating those cores) and
    the share the host took from this virtual machine (``steal``: a vCPU not running
    stalls whatever it was running, the supervisor's loop included)."""
    total = idle = steal = 0.0
    for cpu, (b, a) in enumerate(zip(before, after, strict=True)):
        if cpus is None or cpu in cpus:
            total += sum(a) - sum(b)
            idle += (a.idle - b.idle) + (a.iowait - b.iowait)
            steal += getattr(a, "steal", 0.0) - getattr(b, "steal", 0.0)
    if total <= 0:
        return float("nan"), float("nan")
    return 1.0 - idle / total, steal / total


def run_delay(pid: int) -> float:
    """Seconds the thread ``pid`` (the supervisor's event loop) has spent runnable but
    waiting for a CPU (``/proc/PID/schedstat``); NaN where the kernel does not keep it."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return float("nan")


def cpu_list(text: str) -> set[int]:
    """``0``, ``0,2`` or ``0-3`` (the cpuset list format) -> a set of CPU numbers."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def one_run(args: argparse.Namespace, loaded: bool, crash_every: float) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="health-load-") as tmp:
        base = Path(tmp)
        proc, port = start_supervisor(base, args, crash_every)
        if args.supervisor_nice:  # its main thread (the event loop's) only: on Linux a
            # nice value is a thread's, and the workers are forked from the spawner thread
            os.setpriority(os.PRIO_PROCESS, proc.pid, args.supervisor_nice)
        try:
            wait_serving(port, settle=args.settle)
            http: dict[str, object] = {}
            before, delay = psutil.cpu_times(percpu=True), run_delay(proc.pid)
            if loaded:
                if args.client_nice:  # this process only: the supervisor keeps nice 0
                    os.setpriority(os.PRIO_PROCESS, 0, args.client_nice)
                results = asyncio.run(drive(f"http://127.0.0.1:{port}/healthz", args.rate,
                                            args.duration, args.concurrency))
                with contextlib.redirect_stdout(io.StringIO()):  # keep stdout one table
                    http = report(results, args.rate, as_json=True)
            else:
                time.sleep(args.duration)
            after = psutil.cpu_times(percpu=True)
            busy, steal = cpu_shares(before, after, args.supervisor_cpus)
            delay = run_delay(proc.pid) - delay
        finally:
            if args.client_nice:
                os.setpriority(os.PRIO_PROCESS, 0, 0)
            stop_session(proc)
        lat = restart_latencies(base / "out")
        return {"loaded": loaded, "restarts": len(lat), "cpu_busy": busy, "cpu_steal": steal,
                "loop_run_delay_ms": delay * 1000,
                "restart_p50_ms": statistics.median(lat) if lat else float("nan"),
                "restart_max_ms": max(lat) if lat else float("nan"), "http": http}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--rate", type=float, default=2000.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--line-rate", type=float, default=500.0, help="lines/s per worker")
    parser.add_argument("--crash-every", type=float, default=2.0)
    parser.add_argument("--settle", type=float, default=1.0, help="seconds before the load")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--supervisor-nice", type=int, default=0,
                        help="nice value of the supervisor's event-loop thread alone (root "
                             "for < 0); its workers keep nice 0")
    parser.add_argument("--client-nice", type=int, default=0,
                        help="nice value of the load client while it runs (root for < 0): "
                             "-10 keeps its own wait for a CPU out of the latencies, so "
                             "they show the supervisor's")
    parser.add_argument("--supervisor-cgroup", type=Path, default=None,
                        help="a cgroup directory (v1 cpu or v2, root) the supervisor and its "
                             "workers run in, the load client outside it: a CPU-limited "
                             "cgroup stands in for a slower node probed from elsewhere")
    parser.add_argument("--supervisor-cpus", type=cpu_list, default=None,
                        help="CPUs (e.g. 1 or 2-3) the supervisor and its workers are bound to "
                             "(an inherited affinity, no root needed); CPU busy is then "
                             "reported for these CPUs alone")
    parser.add_argument("--client-cpus", type=cpu_list, default=None,
                        help="CPUs this benchmark and its load client are bound to, e.g. the "
                             "ones --supervisor-cpus leaves free: the prober then does not "
                             "take CPU from the node it probes")
    parser.add_argument("--supervisor-flags", default="",
                        help="extra flags for the supervisor, e.g. '--preload torch' (its "
                             "standbys then import torch at idle priority between restarts)")
    args = parser.parse_args()
    allowed = os.sched_getaffinity(0)
    for flag, cpus in (("--supervisor-cpus", args.supervisor_cpus),
                       ("--client-cpus", args.client_cpus)):
        if cpus and not cpus <= allowed:
            parser.error(f"{flag}: CPUs {sorted(cpus - allowed)} are not available here "
                         f"(available: {sorted(allowed)})")
    if args.client_cpus:
        os.sched_setaffinity(0, args.client_cpus)
    flood = one_run(args, loaded=True, crash_every=1e9)  # flooding, no restarts
    unloaded = one_run(args, loaded=False, crash_every=args.crash_every)
    loaded = one_run(args, loaded=True, crash_every=args.crash_every)
    ratio = float(loaded["restart_p50_ms"]) / float(unloaded["restart_p50_ms"])  # type: ignore[arg-type]
    steady, busy = flood["http"], loaded["http"]
    assert isinstance(steady, dict) and isinstance(busy, dict)
    print(f"| measure (8 workers x {args.line_rate:.0f} lines/s through --tee 3) | "
          "flood only | flood + restarts | target |")
    print("|---|---|---|---|")
    for key, label, target in (("p50_ms", "/healthz p50 ms", ""),
                               ("p99_ms", "/healthz p99 ms", "<= 10"),
                               ("max_ms", "/healthz max ms", ""),
                               ("achieved_rate", "achieved requests/s", f">= {args.rate:.0f}"),
                               ("errors", "errors", "0")):
        print(f"| {label} | {steady[key]} | {busy[key]} | {target} |")
    where = "all cores" if args.supervisor_cpus is None else "the supervisor's CPUs"
    print(f"| CPU busy ({where}) | {flood['cpu_busy']:.0%} | "
          f"{loaded['cpu_busy']:.0%} | |")
    print(f"| CPU stolen by the host (the same CPUs) | {flood['cpu_steal']:.1%} | "
          f"{loaded['cpu_steal']:.1%} | |")
    print(f"| event loop waiting for a CPU, ms in all | {flood['loop_run_delay_ms']:.0f} | "
          f"{loaded['loop_run_delay_ms']:.0f} | |")
    print(f"| crash -> restarted rank 0, median ms | unloaded: {unloaded['restart_p50_ms']:.1f} "
          f"({unloaded['restarts']} restarts) | under load: {loaded['restart_p50_ms']:.1f} "
          f"({loaded['restarts']} restarts) | |")
    print(f"| restart latency, loaded / unloaded | | {ratio:.2f}x | <= 1.5x |")
    if args.json:
        runs = {"flood": flood, "unloaded": unloaded, "loaded": loaded}
        args.json.write_text(json.dumps(runs, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
