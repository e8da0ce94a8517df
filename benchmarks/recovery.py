"""Recovery of a real DDP job, side by side with torchrun (issue 15's benchmark).

    python benchmarks/recovery.py [--ranks 2,4] [--crashes kill,exit] [--reps 10]
                                  [--torchrun-runs 12] [--json FILE] [--only NAMES]

The job is ``benchmarks/recovery_job.py`` (torch CPU, gloo, ``Linear(64, 64)`` under DDP).
One run of a launcher crashes the job ``reps`` times (the last rank exits 3, or is
SIGKILLed) and the figure of each crash is **crash -> first completed step of the next
attempt, on every rank** (the latest rank's first step), from the workers' own wall-clock
records; the phases of that time come from the same records (new interpreter running,
``import torch``, ``init_process_group``, DDP and the first step). Cells, in one run:

- ours cold (``--no-warm-restart``), ours warm, ours warm with
  ``--preload torch,torch._dynamo``, ours warm with ``--preload auto`` (its crashes come
  at --crash-after or 10 s, whichever is later: auto's standbys start 5.5 s after a launch),
  and the same again in a log directory holding the list the auto cell's run kept
  (``LOG_DIR/RUN_ID/preload-auto.json``: the job run a second time on the node; its
  crashes come at --crash-after, as for an explicit list), and auto's first run with
  ``--fork-first-attempt`` on a one-node etcd rendezvous that waits a 1 s last call (the
  first attempt runs in interpreters forked from a server with nothing preloaded, so its
  workers record every module they import; crashes as for auto);
- torchrun ``--standalone`` and torchrun static (``--rdzv-backend static``), same job.

torchrun's restarts of this job often fail (the restarted ranks read the previous
attempt's gloo addresses from the store it reuses): a torchrun run ends at its first
failed recovery, so torchrun is run again (up to ``--torchrun-runs`` times per cell) until
it has ``reps`` successful recoveries or the cap, and the success rate is reported.
Standby memory (RSS, USS) is read while the preloaded standbys wait.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from benchmarks.fork_cpu import READY, import_seconds, spent
from benchmarks.harness import BIN, HERE, ensure_bytecode, free_port, launcher_env
from benchmarks.healing import etcd_server
from supervisor.workers.warm.forkserver import is_fork_server_command
from supervisor.workers.warm.standby import is_standby_command

JOB = HERE / "recovery_job.py"
PHASES = ("interpreter", "import torch", "init_process_group", "DDP + first step")


@dataclass
class Cell:
    name: str
    kind: str  # ours | torchrun
    flags: tuple[str, ...] = ()
    crash_after: float | None = None  # s of training before each crash, if not --crash-after
    recoveries: list[float] = field(default_factory=list)
    by_crash: dict[int, list[float]] = field(default_factory=dict)  # crash k of a run
    phases: list[dict[str, float]] = field(default_factory=list)
    runs: int = 0
    failed_runs: int = 0
    standby_rss: list[int] = field(default_factory=list)
    standby_uss: list[int] = field(default_factory=list)
    server_rss: list[int] = field(default_factory=list)  # the fork server's, if any
    # the fork server's CPU (with its reaped intermediate children's) per attempt after
    # its preload: what forking each attempt's standbys cost, one figure per run
    fork_cpu: list[float] = field(default_factory=list)
    seed_from: str | None = None  # a cell whose last run's kept auto list this one starts with
    # a one-node etcd rendezvous that waits a last call (1 s) for more nodes, as an elastic
    # job's does: what lets a fork server be ready before the first attempt
    etcd: bool = False


KEPT = Path("none") / "preload-auto.json"  # --preload auto's list, in the run directory
kept_lists: dict[str, bytes] = {}  # cell name -> the list its last run kept


def command(cell: Cell, ranks: int, restarts: int, logs: Path) -> list[str]:
    common = ["--nproc-per-node", str(ranks), "--max-restarts", str(restarts),
              "--log-dir", str(logs)]
    if cell.kind == "ours":
        ensure_bytecode()
        exe = BIN / "elastic-supervisor"
        head = [str(exe), "run"] if exe.exists() else [sys.executable, "-m", "supervisor", "run"]
        rdzv = ["--nnodes", "1"]
        if cell.etcd:
            rdzv = ["--nnodes", "1:2", "--rdzv-backend", "etcd", "--rdzv-endpoint", ETCD[0],
                    "--rdzv-id", f"recovery-{os.getpid()}-{time.monotonic_ns()}",
                    "--rdzv-conf", "last_call_timeout=1"]
        return [*head, *rdzv, *common, "--health-port", "0", *cell.flags]
    exe = BIN / "torchrun"
    head = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    if cell.name.endswith("static"):
        rdzv = ["--rdzv-backend", "static", "--nnodes", "1", "--node-rank", "0",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    else:
        rdzv = ["--standalone", "--nnodes", "1"]
    return [*head, *rdzv, *common]


ETCD = [""]  # the etcd of the cells that need one (started by main)
CRASH_AFTER = ["--crash-after", "5"]  # s of training before each crash (the job's default)


def run_once(cell: Cell, ranks: int, crashes: int, kill: bool, timeout: float) -> int:
    """One launcher run; adds its recoveries to the cell; returns how many it had."""
    root = Path(tempfile.mkdtemp(prefix=f"recovery-{cell.kind}-"))
    out = root / "out"
    out.mkdir()
    if cell.seed_from is not None and cell.seed_from in kept_lists:
        (root / "logs" / KEPT.parent).mkdir(parents=True, mode=0o700)
        (root / "logs" / KEPT).write_bytes(kept_lists[cell.seed_from])
    argv = [*command(cell, ranks, crashes, root / "logs"), str(JOB), str(out),
            "--crashes", str(crashes),
            *(["--crash-after", str(cell.crash_after)] if cell.crash_after is not None
              else CRASH_AFTER),
            *(["--kill"] if kill else [])]
    env = launcher_env()
    with open(root / "err", "wb") as err:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=err, env=env, cwd=root, start_new_session=True)
    cpu = ForkCpu(root / "err") if "--preload" in cell.flags else None
    try:
        deadline = time.monotonic() + timeout
        # the standbys are sampled every SAMPLE_EVERY s until the first crash, and the last
        # complete sample counts: an auto run's first standbys come from a server with
        # nothing preloaded, replaced once auto has learned (5.5 s after the launch)
        sample: Sample | None = None
        next_sample = 0.0
        while proc.poll() is None and time.monotonic() < deadline:
            if (cpu is not None and time.monotonic() >= next_sample
                    and (out / "a0_r0.json").exists() and not (out / "crash_0").exists()):
                sample = sample_standbys(proc.pid, ranks) or sample
                next_sample = time.monotonic() + SAMPLE_EVERY
            if cpu is not None:
                cpu.poll()
            if stalled(out, ranks, crashes) or done(out, ranks, crashes):
                break  # a recovery that did not happen: this run is over (torchrun's)
            time.sleep(0.05)
        if cpu is not None:
            cpu.poll(final=True)
    finally:
        stop(proc)
    if sample is not None:
        cell.server_rss += sample.server_rss
        cell.standby_rss += sample.standby_rss
        cell.standby_uss += sample.standby_uss
    found = collect(cell, out, ranks, crashes)
    with contextlib.suppress(OSError):
        kept_lists[cell.name] = (root / "logs" / KEPT).read_bytes()
    if cpu is not None and (per := cpu.per_attempt(found + 1)) is not None:
        cell.fork_cpu.append(per)
    cell.runs += 1
    if found < crashes:
        cell.failed_runs += 1
    if os.environ.get("BENCH_KEEP"):
        print(f"  kept {root}", file=sys.stderr)
    else:
        shutil.rmtree(root, ignore_errors=True)
    return found


# s after a crash without every rank's first step: the recovery failed (``--stall``; a
# cold restart on a 2-core machine shared with other jobs took 12-16 s)
STALL = [12.0]


class ForkCpu:
    """The fork server's CPU from its ready line (its preload done) to the end of a run."""

    def __init__(self, err: Path) -> None:
        self.err = err
        self.server: psutil.Process | None = None
        self.ready = self.end = 0.0

    def poll(self, final: bool = False) -> None:
        with contextlib.suppress(psutil.Error, OSError):
            if self.server is None and (m := READY.search(self.err.read_text())):
                self.server = psutil.Process(int(m.group(1)))
                self.ready = spent(self.server)
            if final and self.server is not None:
                self.end = spent(self.server)

    def per_attempt(self, launches: int) -> float | None:
        """Seconds per launch (each forks the next attempt's standbys); None if unknown
        (no server seen, or it was replaced: auto's second server)."""
        if self.server is None or not self.end:
            return None
        return (self.end - self.ready) / launches


def done(out: Path, ranks: int, crashes: int) -> bool:
    """Whether the last recovery has happened (every rank of the last attempt stepped):
    the run's figures are complete, and its fork server is sampled before it stops."""
    return all((out / f"a{crashes}_r{r}.json").exists() for r in range(ranks))


def stalled(out: Path, ranks: int, crashes: int) -> bool:
    """Whether the last crash has gone ``STALL`` s without the next attempt stepping."""
    last = max((k for k in range(crashes) if (out / f"crash_{k}").exists()), default=None)
    if last is None:
        return False
    if all((out / f"a{last + 1}_r{r}.json").exists() for r in range(ranks)):
        return False
    return time.time() - float((out / f"crash_{last}").read_text()) > STALL[0]


SAMPLE_EVERY = 2.0  # s between two samples of the standbys' memory


@dataclass
class Sample:
    """The memory of one run's standbys (and fork server) at one moment."""

    server_rss: list[int]
    standby_rss: list[int]
    standby_uss: list[int]


def sample_standbys(pid: int, ranks: int) -> Sample | None:
    """RSS/USS of the preloaded standbys, if they are all there and done importing."""
    try:
        children = psutil.Process(pid).children(recursive=True)
        standbys = [p for p in children if is_standby_command(p.cmdline())]
        # forked standbys show their fork server's command line: the oldest such process
        # is the server (its RSS is reported apart)
        forked = sorted((p for p in children if is_fork_server_command(p.cmdline())),
                        key=lambda p: p.create_time())
    except psutil.Error:
        return None
    server_rss: list[int] = []
    if forked:
        server, standbys = forked[0], standbys + forked[1:]
        with contextlib.suppress(psutil.Error):
            server_rss.append(server.memory_info().rss)
    if len(standbys) < ranks:
        return None
    try:
        if any(p.cpu_percent(interval=0.2) > 5 for p in standbys):
            return None  # still importing
        return Sample(server_rss, [p.memory_info().rss for p in standbys],
                      [p.memory_full_info().uss for p in standbys])
    except psutil.Error:
        return None


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(20)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # anything left in its session (torchrun's)
    proc.wait()


def collect(cell: Cell, out: Path, ranks: int, crashes: int) -> int:
    found = 0
    for k in range(crashes):
        crash = out / f"crash_{k}"
        records = [out / f"a{k + 1}_r{r}.json" for r in range(ranks)]
        if not crash.exists() or not all(p.exists() for p in records):
            break
        t_crash = float(crash.read_text())
        recs = [json.loads(p.read_text()) for p in records]
        last = max(recs, key=lambda r: r["step"])
        cell.recoveries.append(last["step"] - t_crash)
        cell.by_crash.setdefault(k, []).append(last["step"] - t_crash)
        cell.phases.append({
            PHASES[0]: max(r["start"] for r in recs) - t_crash,
            PHASES[1]: statistics.median(r["torch"] - r["start"] for r in recs),
            PHASES[2]: statistics.median(r["pg"] - r["torch"] for r in recs),
            PHASES[3]: statistics.median(r["step"] - r["pg"] for r in recs),
        })
        found += 1
    return found


def cells(crash_after: float, auto_crash_after: float | None = None) -> list[Cell]:
    """The cells; auto's crash comes at ``--crash-after`` or 10 s, whichever is later
    (``--auto-crash-after``: then, for its early crashes)."""
    auto_after = max(10.0, crash_after) if auto_crash_after is None else auto_crash_after
    return [
        Cell("ours cold", "ours", ("--no-warm-restart",)),
        Cell("ours warm", "ours"),
        Cell("ours warm + preload", "ours", ("--preload", "torch,torch._dynamo")),
        # auto's standbys start 5.5 s after a launch (a warm worker records its imports
        # 1 and 5 s after it started), then import at idle priority: crashes come later
        Cell("ours warm + preload auto", "ours", ("--preload", "auto"),
             crash_after=auto_after),
        # with the list the auto cell's run kept, the fork server imports it from the
        # supervisor's start, as for an explicit list: its crashes come at --crash-after
        Cell("ours warm + preload auto again", "ours", ("--preload", "auto"),
             seed_from="ours warm + preload auto"),
        # auto's first run with the first attempt forked from a server with nothing
        # preloaded (ready while the round waits its last call): those workers record every
        # module they import, so auto learns torch._dynamo before the first restart
        Cell("ours warm + preload auto + forked first attempt", "ours",
             ("--preload", "auto", "--fork-first-attempt"),
             crash_after=auto_after, etcd=True),
        Cell("torchrun standalone", "torchrun"),
        Cell("torchrun static", "torchrun"),
    ]


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--crashes", default="exit,kill")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--torchrun-runs", type=int, default=12)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--only", default="",
                    help="comma-separated cell names to run (e.g. 'ours cold')")
    ap.add_argument("--crash-after", type=float, default=5.0,
                    help="seconds of training before each crash; below a standby's import "
                         "time (~2.5 s) the crash comes while the standbys still import")
    ap.add_argument("--auto-crash-after", type=float, default=None,
                    help="seconds of training before each crash of the auto cells (default: "
                         "--crash-after or 10, whichever is later)")
    ap.add_argument("--ours-runs", type=int, default=1,
                    help="runs of each of our cells (each crashes --reps times)")
    ap.add_argument("--stall", type=float, default=STALL[0],
                    help="seconds after a crash without a first step: a failed recovery")
    a = ap.parse_args()
    print(f"import torch alone: {import_seconds('torch'):.2f} s on this machine; the job "
          "steps every 20 ms, mostly waiting", file=sys.stderr, flush=True)
    CRASH_AFTER[1] = str(a.crash_after)
    STALL[0] = a.stall
    with contextlib.ExitStack() as stack:
        if any(cell.etcd for cell in selected(a)):
            data = stack.enter_context(tempfile.TemporaryDirectory(prefix="recovery-etcd-"))
            ETCD[0] = stack.enter_context(etcd_server(Path(data)))
        results = run_cells(a)
    table(results)
    ratios(results)
    mem = [r for r in results if r.get("standby_rss_mib")]
    if mem:
        print("\nPreloaded standby, median per standby: "
              + "; ".join(f"{r['launcher']}, {r['ranks']} ranks, {r['crash']}: RSS "
                          f"{r['standby_rss_mib']:.0f} MiB, USS {r['standby_uss_mib']:.0f} MiB"
                          + (f", fork server CPU per attempt {r['fork_cpu_per_attempt_ms']:.1f} ms"
                             if r.get("fork_cpu_per_attempt_ms") else "")
                          for r in mem))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


def selected(a: argparse.Namespace) -> list[Cell]:
    """Fresh cells (no figures yet), those ``--only`` names if it is given."""
    only = set(a.only.split(",")) if a.only else None
    return [cell for cell in cells(a.crash_after, a.auto_crash_after)
            if only is None or cell.name in only]


def run_cells(a: argparse.Namespace) -> list[dict[str, object]]:
    """Every selected cell, for each rank count and kind of crash; a row per cell."""
    results = []
    for ranks in (int(r) for r in a.ranks.split(",")):
        for mode in a.crashes.split(","):
            kill = mode == "kill"
            for cell in selected(a):
                started = time.monotonic()
                if cell.kind == "ours":
                    for _ in range(a.ours_runs):
                        run_once(cell, ranks, a.reps, kill, timeout=60 + 15 * a.reps)
                else:
                    while len(cell.recoveries) < a.reps and cell.runs < a.torchrun_runs:
                        run_once(cell, ranks, a.reps - len(cell.recoveries), kill,
                                 timeout=60 + 15 * a.reps)
                row = summarise(cell, ranks, mode, time.monotonic() - started)
                results.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    return results


def summarise(cell: Cell, ranks: int, mode: str, seconds: float) -> dict[str, object]:
    phases = {p: median([ph[p] for ph in cell.phases]) for p in PHASES}
    return {
        "ranks": ranks, "crash": mode, "launcher": cell.name, "n": len(cell.recoveries),
        "median": median(cell.recoveries),
        # crash k of each run: 0 ends attempt 0, 1 ends attempt 1 (a crash loop), ...
        "by_crash": {k: median(v) for k, v in sorted(cell.by_crash.items())},
        "min": min(cell.recoveries) if cell.recoveries else None,
        "max": max(cell.recoveries) if cell.recoveries else None,
        "phases": phases, "runs": cell.runs, "failed_runs": cell.failed_runs,
        "standby_rss_mib": (median([float(v) for v in cell.standby_rss]) or 0) / 2**20 or None,
        "standby_uss_mib": (median([float(v) for v in cell.standby_uss]) or 0) / 2**20 or None,
        "fork_server_rss_mib": (median([float(v) for v in cell.server_rss]) or 0) / 2**20
        or None,
        "fork_cpu_per_attempt_ms": (median(cell.fork_cpu) or 0) * 1e3 or None,
        "seconds": round(seconds, 1),
    }


def ratios(results: list[dict[str, object]]) -> None:
    """How many times faster ``ours warm + preload`` recovered than each other cell."""
    print("\n| ranks | crash | preload median s | x vs ours cold | x vs ours warm |"
          " x vs torchrun standalone | x vs torchrun static |")
    print("|---|---|---|---|---|---|---|")
    groups: dict[tuple[object, object], dict[str, object]] = {}
    for r in results:
        groups.setdefault((r["ranks"], r["crash"]), {})[str(r["launcher"])] = r["median"]
    for (ranks, crash), cells in groups.items():
        base = cells.get("ours warm + preload")
        if not isinstance(base, float):
            continue

        def x(name: str, cells: dict[str, object] = cells, base: float = base) -> str:
            other = cells.get(name)
            return f"{other / base:.1f}x" if isinstance(other, float) else "n/a"

        print(f"| {ranks} | {crash} | {base:.3f} | {x('ours cold')} | {x('ours warm')} | "
              f"{x('torchrun standalone')} | {x('torchrun static')} |")


def table(results: list[dict[str, object]]) -> None:
    print("\n| ranks | crash | launcher | recoveries | median s | min-max s | phases (median s) |"
          " runs failed |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        med = r["median"]
        phases = r["phases"]
        assert isinstance(phases, dict)
        ph = ", ".join(f"{k} {v:.3f}" for k, v in phases.items() if v is not None)
        span = (f"{r['min']:.3f}-{r['max']:.3f}" if r["min"] is not None else "-")
        print(f"| {r['ranks']} | {r['crash']} | {r['launcher']} | {r['n']} | "
              f"{med:.3f} | {span} | {ph} | {r['failed_runs']}/{r['runs']} |"
              if isinstance(med, float) else
              f"| {r['ranks']} | {r['crash']} | {r['launcher']} | 0 | never recovered | - | - |"
              f" {r['failed_runs']}/{r['runs']} |")


if __name__ == "__main__":
    sys.exit(main())
