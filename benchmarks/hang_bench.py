"""Hang detection, side by side: elastic-supervisor vs torchrun's FileTimer watchdog.

Each run starts 2 workers. Rank 0 posts a deadline with torch's own ``FileTimerClient``
(1.0-1.1 s ahead, random phase) and hangs; rank 1 is a healthy sibling. The harness
watches rank 0 through a pidfd and records when it died relative to its deadline, whether
the group was restarted (a restart-1 worker appears), and whether the sibling of the first
attempt was left running (an orphan) once the launcher is done or gone.

    python benchmarks/hang_bench.py --runs 30
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import BIN

WORKER = r"""
import json, os, random, sys, time
out = sys.argv[1]
rank = int(os.environ["RANK"]); restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
record = {"rank": rank, "pid": os.getpid(), "restart": restart}
if restart == 0 and rank == 0:
    from torch.distributed.elastic.timer import FileTimerClient
    deadline = time.time() + 1.0 + random.random() * 0.1
    FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"], signal=9).acquire("step", deadline)
    record["deadline"] = deadline
with open(os.path.join(out, f"{restart}-{rank}.json"), "w") as f:
    json.dump(record, f)
if restart == 0:
    time.sleep(3600)
"""


@dataclass
class Run:
    late: float | None  # seconds from deadline to the hung worker's death
    restarted: bool
    orphans: int
    noticed: float | None = None  # ours: deadline -> expiry handled (events.jsonl "late")


def wait_file(path: Path, timeout: float) -> dict[str, object] | None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists():
            try:
                return json.loads(path.read_text())
            except ValueError:
                pass
        time.sleep(0.002)
    return None


def wait_restart(path: Path, proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """True once a restarted worker appears; False at the timeout or once the launcher is
    gone (torchrun's watchdog kills its own agent, so nothing can restart)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists():
            return True
        if proc.poll() is not None:
            return path.exists()
        time.sleep(0.005)
    return False


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def death_time(pid: int, timeout: float) -> float | None:
    """Wall-clock time the process exited, observed through its pidfd."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        return time.time() if ready else None
    finally:
        os.close(fd)


def launcher(kind: str, script: Path, out: Path, logs: Path) -> subprocess.Popen[bytes]:
    py = sys.executable
    env = dict(os.environ)
    if kind == "elastic-supervisor":
        cmd = [py, "-m", "supervisor", "run", "--health-port", "0", "--nproc-per-node", "2",
               "--max-restarts", "1", "--shutdown-timeout", "2", "--log-dir", str(logs)]
    else:
        env["TORCHELASTIC_ENABLE_FILE_TIMER"] = "1"
        env["TORCHELASTIC_TIMER_FILE"] = str(out / "torch-timer.fifo")
        cmd = [str(BIN / "torchrun"), "--nproc-per-node", "2", "--max-restarts", "1",
               "--log-dir", str(logs)]
    return subprocess.Popen([*cmd, str(script), str(out)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def one_run(kind: str, base: Path, i: int) -> Run:
    out = base / f"{kind}-{i}"
    out.mkdir()
    script = base / "worker.py"
    proc = launcher(kind, script, out, out / "logs")
    try:
        hung = wait_file(out / "0-0.json", 60)
        sibling = wait_file(out / "0-1.json", 60)
        if hung is None or sibling is None:
            return Run(None, False, 0)
        died = death_time(int(hung["pid"]), 10)  # type: ignore[call-overload]
        late = None if died is None else died - float(hung["deadline"])  # type: ignore[arg-type]
        restarted = wait_restart(out / "1-0.json", proc, 8)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        orphans = int(alive(int(sibling["pid"])))  # type: ignore[call-overload]
        return Run(late, restarted, orphans, noticed_late(out / "logs"))
    finally:
        cleanup(proc, out)


def noticed_late(logs: Path) -> float | None:
    """Our supervisor's own record of how late it handled the deadline."""
    for path in logs.glob("*/events.jsonl"):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == "deadline_expired":
                return float(event["late"])
    return None


def kill_teardown_ms(samples: int = 5) -> float:
    """The floor under any launcher: SIGKILL -> exit of a process that imported torch."""
    times = []
    code = ("import sys\nfrom torch.distributed.elastic.timer import FileTimerClient\n"
            "sys.stdout.write('r\\n'); sys.stdout.flush()\nimport time; time.sleep(60)")
    for _ in range(samples):
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        assert proc.stdout is not None
        proc.stdout.readline()
        fd = os.pidfd_open(proc.pid)
        started = time.perf_counter()
        os.kill(proc.pid, signal.SIGKILL)
        select.select([fd], [], [], 10)
        times.append((time.perf_counter() - started) * 1e3)
        os.close(fd)
        proc.wait()
    return statistics.median(times)


def cleanup(proc: subprocess.Popen[bytes], out: Path) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for record in out.glob("*.json"):  # orphans the launcher left behind
        try:
            pid = int(json.loads(record.read_text())["pid"])
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        except (ValueError, OSError, KeyError):
            continue


def summarise(kind: str, runs: list[Run]) -> dict[str, object]:
    lates = [r.late * 1000 for r in runs if r.late is not None]
    return {
        "launcher": kind,
        "runs": len(runs),
        "median_ms": statistics.median(lates) if lates else float("nan"),
        "max_ms": max(lates) if lates else float("nan"),
        "restarted": sum(r.restarted for r in runs),
        "orphans": sum(r.orphans for r in runs),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--json", type=Path, default=None, help="raw lateness samples here")
    args = parser.parse_args()
    results: dict[str, list[Run]] = {"elastic-supervisor": [], "torchrun": []}
    with tempfile.TemporaryDirectory(prefix="hang-bench-") as tmp:
        base = Path(tmp)
        (base / "worker.py").write_text(WORKER)
        for i in range(args.runs):
            for kind in (results if i % 2 == 0 else reversed(list(results))):
                results[kind].append(one_run(kind, base, i))
    rows = [summarise(kind, runs) for kind, runs in results.items()]
    ours, theirs = rows
    print("| launcher | runs | deadline -> dead, median ms | max ms | group restarted | "
          "orphans left |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['launcher']} | {row['runs']} | {row['median_ms']:.1f} | "
              f"{row['max_ms']:.1f} | {row['restarted']}/{row['runs']} | {row['orphans']} |")
    ratio = float(theirs["median_ms"]) / max(float(ours["median_ms"]), 1e-6)  # type: ignore[arg-type]
    print(f"\nmedian lateness ratio torchrun/ours: {ratio:.1f}x")
    noticed = [r.noticed * 1e3 for r in results["elastic-supervisor"] if r.noticed is not None]
    if noticed:
        print(f"ours, deadline -> expiry handled and signal sent (events.jsonl): median "
              f"{statistics.median(noticed):.1f} ms, max {max(noticed):.1f} ms")
    print(f"floor for any launcher, SIGKILL -> exit of a process with torch imported: "
          f"median {kill_teardown_ms():.1f} ms")
    if args.json:
        raw = {kind: [r.late for r in runs] for kind, runs in results.items()}
        args.json.write_text(json.dumps({"summary": rows, "late_s": raw}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
