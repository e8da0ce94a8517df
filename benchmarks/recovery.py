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
  ``--preload torch,torch._dynamo`` (every attempt, the first included, forked from the
  node's fork server), ours warm with ``--preload auto`` (its crashes come at
  --crash-after or 10 s, whichever is later: auto learns 5.5 s after a launch), and the
  same again in a log directory holding the list the auto cell's run kept
  (``LOG_DIR/RUN_ID/preload-auto.json``: the job run a second time on the node);
- torchrun ``--standalone`` and torchrun static (``--rdzv-backend static``), same job;
- the busy node (``busy: ...``): each rank reads from a ``DataLoader`` with 2 CPU-bound
  worker processes and never sleeps between steps, one crash 20 s into attempt 0 per run
  (``--busy-runs`` runs): ours cold, ``--preload torch,torch._dynamo``, ``--preload auto``,
  the list with the fork server SIGKILLed 5 s into the run (its replacement imports under
  the load), and torchrun ``--standalone``;
- the production form (``prod: ...``): ``--no-python JOBVENV/bin/python -u JOB``, a second
  venv (made by this script, ``python -m venv``) that sees torch through a ``.pth`` line and
  holds a package ours lacks: ours cold and ``--preload torch,torch._dynamo``.

Each of our cells also reports the fork server's import time (its ``ready`` line): the
first server's, and any later one's (auto's second, a replacement).

The first attempt (``--first-attempt-runs``, 0: skipped): launch -> first step on every rank
of a job that does not crash, with 2 and 8 ranks (``--first-attempt-ranks``), ours cold
(no ``--preload``) against ours with ``--preload torch,torch._dynamo`` (the first attempt
waits for the fork server's import and runs in interpreters forked from it), alternated.

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
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from benchmarks.fork_cpu import READY, import_seconds, spent
from benchmarks.harness import BIN, HERE, ensure_bytecode, free_port, launcher_env, stop_session
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
    job: tuple[str, ...] = ()  # more arguments of the job (the busy node's DataLoader)
    busy: bool = False  # one crash per run, ``--busy-runs`` runs
    kill_server_after: float | None = None  # s after the launcher's start: SIGKILL its server
    production: bool = False  # --no-python JOBVENV/bin/python -u JOB
    imports_first: list[float] = field(default_factory=list)  # each run's first server
    imports_later: list[float] = field(default_factory=list)  # auto's second, a replacement


KEPT = Path("none") / "preload-auto.json"  # --preload auto's list, in the run directory
kept_lists: dict[str, bytes] = {}  # cell name -> the list its last run kept


def command(cell: Cell, ranks: int, restarts: int, logs: Path) -> list[str]:
    common = ["--nproc-per-node", str(ranks), "--max-restarts", str(restarts),
              "--log-dir", str(logs)]
    if cell.kind == "ours":
        ensure_bytecode()
        exe = BIN / "elastic-supervisor"
        head = [str(exe), "run"] if exe.exists() else [sys.executable, "-m", "supervisor", "run"]
        form = ["--no-python", JOB_VENV[0], "-u"] if cell.production else []
        return [*head, "--nnodes", "1", *common, "--health-port", "0", *cell.flags, *form]
    exe = BIN / "torchrun"
    head = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    if cell.name.endswith("static"):
        rdzv = ["--rdzv-backend", "static", "--nnodes", "1", "--node-rank", "0",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    else:
        rdzv = ["--standalone", "--nnodes", "1"]
    return [*head, *rdzv, *common]


JOB_VENV = [""]  # the production form's interpreter (made by main)
CRASH_AFTER = ["--crash-after", "5"]  # s of training before each crash (the job's default)


def run_once(cell: Cell, ranks: int, crashes: int, kill: bool, timeout: float) -> int:
    """One launcher run; adds its recoveries (and its fork servers' import times) to the
    cell; returns how many it had."""
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
            *(["--kill"] if kill else []), *cell.job]
    env = launcher_env()
    with open(root / "err", "wb") as err:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=err, env=env, cwd=root, start_new_session=True)
    cpu = ForkCpu(root / "err") if "--preload" in cell.flags else None
    started = time.monotonic()
    killed = cell.kill_server_after is None
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
            if not killed and time.monotonic() - started >= (cell.kill_server_after or 0):
                killed = kill_fork_server(proc.pid)
            limit = max(STALL[0], BUSY_STALL) if cell.busy else STALL[0]
            if stalled(out, ranks, crashes, limit) or done(out, ranks, crashes):
                break  # a recovery that did not happen: this run is over (torchrun's)
            time.sleep(0.05)
        if cpu is not None:
            cpu.poll(final=True)
    finally:
        stop_session(proc, 20)
    if sample is not None:
        cell.server_rss += sample.server_rss
        cell.standby_rss += sample.standby_rss
        cell.standby_uss += sample.standby_uss
    found = collect(cell, out, ranks, crashes)
    imports = [float(t) for t in IMPORTED.findall((root / "err").read_text(errors="replace"))]
    cell.imports_first += imports[:1]
    cell.imports_later += imports[1:]
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


IMPORTED = re.compile(r"fork server \(pid \d+\) ready: preloaded \S+ in ([\d.]+) s")


def kill_fork_server(launcher: int) -> bool:
    """SIGKILL the launcher's fork server (the oldest process with its command line: the
    standbys it forked show the same one); whether one was found."""
    with contextlib.suppress(psutil.Error):
        children = psutil.Process(launcher).children(recursive=True)
        servers = sorted((p for p in children if is_fork_server_command(p.cmdline())),
                         key=lambda p: p.create_time())
        if servers:
            servers[0].kill()
            print(f"  killed the fork server (pid {servers[0].pid})", file=sys.stderr)
            return True
    return False


# s after a crash without every rank's first step: the recovery failed (``--stall``; a
# cold restart on a 2-core machine shared with other jobs took 12-16 s)
STALL = [12.0]
# the same on the busy node: a cold restart there took over 12 s on the shared machine
BUSY_STALL = 90.0


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


def stalled(out: Path, ranks: int, crashes: int, limit: float) -> bool:
    """Whether the last crash has gone ``limit`` s without the next attempt stepping."""
    last = max((k for k in range(crashes) if (out / f"crash_{k}").exists()), default=None)
    if last is None:
        return False
    if all((out / f"a{last + 1}_r{r}.json").exists() for r in range(ranks)):
        return False
    return time.time() - float((out / f"crash_{last}").read_text()) > limit


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


BUSY_JOB = ("--loader-workers", "2", "--step-sleep", "0")
LIST = ("--preload", "torch,torch._dynamo")


def cells(crash_after: float, auto_crash_after: float | None = None) -> list[Cell]:
    """The cells; auto's crash comes at ``--crash-after`` or 10 s, whichever is later
    (``--auto-crash-after``: then, for its early crashes)."""
    auto_after = max(10.0, crash_after) if auto_crash_after is None else auto_crash_after
    return [
        Cell("ours cold", "ours", ("--no-warm-restart",)),
        Cell("ours warm", "ours"),
        Cell("ours warm + preload", "ours", LIST),
        # the first attempt runs in interpreters forked from a server with nothing
        # preloaded; auto learns from their records 5.5 s after the launch, and a second
        # server imports the list: crashes come later
        Cell("ours warm + preload auto", "ours", ("--preload", "auto"),
             crash_after=auto_after),
        # with the list the auto cell's run kept, the fork server imports it from the
        # supervisor's start, as for an explicit list: its crashes come at --crash-after
        Cell("ours warm + preload auto again", "ours", ("--preload", "auto"),
             seed_from="ours warm + preload auto"),
        Cell("torchrun standalone", "torchrun"),
        Cell("torchrun static", "torchrun"),
        busy("busy: ours cold", "ours", ("--no-warm-restart",)),
        busy("busy: ours preload", "ours", LIST),
        busy("busy: ours preload auto", "ours", ("--preload", "auto")),
        busy("busy: ours preload (server killed 5 s in)", "ours", LIST,
             kill_server_after=5.0),
        busy("busy: torchrun standalone", "torchrun"),
        Cell("prod: ours cold", "ours", ("--no-warm-restart",), production=True),
        Cell("prod: ours preload", "ours", LIST, production=True),
    ]


def busy(name: str, kind: str, flags: tuple[str, ...] = (),
         kill_server_after: float | None = None) -> Cell:
    """A busy-node cell: the DataLoader job, one crash 20 s into attempt 0 per run."""
    return Cell(name, kind, flags, crash_after=20.0, job=BUSY_JOB, busy=True,
                kill_server_after=kill_server_after)


def make_job_venv(where: Path) -> str:
    """The production form's venv: ``python -m venv`` (another interpreter path, its own
    site-packages) that sees our venv's torch through a ``.pth`` line (not our package:
    an editable install's finder is itself a ``.pth`` of our venv, not read from there)
    and holds a package ours lacks (``jobvenv_only``, imported by nothing: it only shows
    the venv is the job's). Returns its interpreter."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    (site,) = where.glob("lib/python*/site-packages")
    torch_site = Path(__import__("torch").__file__).parent.parent
    (site / "torch-from-bench.pth").write_text(f"{torch_site}\n")
    (site / "jobvenv_only.py").write_text("VALUE = 1\n")
    return str(where / "bin" / "python")


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
    ap.add_argument("--busy-runs", type=int, default=3,
                    help="runs of each busy-node cell (one crash each, 20 s in)")
    ap.add_argument("--first-attempt-runs", type=int, default=5,
                    help="runs of each launcher for the first-attempt measure (0: skip)")
    ap.add_argument("--first-attempt-ranks", default="2,8")
    a = ap.parse_args()
    print(f"`import torch` alone took {import_seconds('torch'):.2f} s at the start, load "
          f"average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores. Every figure is crash "
          "-> the first completed step of the next attempt on every rank (the latest "
          "rank's), from the workers' own clocks. The job steps every 20 ms, mostly "
          "waiting; the busy cells' ranks read from a DataLoader of 2 CPU-bound workers "
          "each and never wait (6 CPU-bound processes on the node), one crash 20 s into "
          "attempt 0 per run, and their first step includes the DataLoader's first batch.",
          flush=True)
    CRASH_AFTER[1] = str(a.crash_after)
    STALL[0] = a.stall
    with tempfile.TemporaryDirectory(prefix="recovery-jobvenv-") as venv:
        if any(cell.production for cell in selected(a)):
            JOB_VENV[0] = make_job_venv(Path(venv))
        results = run_cells(a)
        firsts = first_attempts(a)
    table(results)
    ratios(results)
    import_table(results)
    first_attempt_table(firsts)
    mem = [r for r in results if r.get("standby_rss_mib")]
    if mem:
        print("\nPreloaded standby, median per standby: "
              + "; ".join(f"{r['launcher']}, {r['ranks']} ranks, {r['crash']}: RSS "
                          f"{r['standby_rss_mib']:.0f} MiB, USS {r['standby_uss_mib']:.0f} MiB"
                          + (f", fork server CPU per attempt {r['fork_cpu_per_attempt_ms']:.1f} ms"
                             if r.get("fork_cpu_per_attempt_ms") else "")
                          for r in mem))
    if a.json:
        a.json.write_text(json.dumps({"recovery": results, "first_attempt": firsts},
                                     indent=1) + "\n")
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
                if cell.busy:
                    while cell.runs < a.busy_runs:
                        run_once(cell, ranks, 1, kill, timeout=180)
                elif cell.kind == "ours":
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
        "import_first_s": median(cell.imports_first),
        "import_later_s": median(cell.imports_later),
        "imports_later_n": len(cell.imports_later),
        "seconds": round(seconds, 1),
    }


RATIOS = (  # (base cell, the cells it is compared with)
    ("ours warm + preload", ("ours cold", "ours warm", "torchrun standalone",
                             "torchrun static")),
    ("busy: ours preload", ("busy: ours cold", "busy: torchrun standalone")),
    ("prod: ours preload", ("prod: ours cold",)),
)


def ratios(results: list[dict[str, object]]) -> None:
    """How many times faster each base cell (``--preload``) recovered than the others."""
    groups: dict[tuple[object, object], dict[str, object]] = {}
    for r in results:
        groups.setdefault((r["ranks"], r["crash"]), {})[str(r["launcher"])] = r["median"]
    for base_name, others in RATIOS:
        lines = []
        for (ranks, crash), found in groups.items():
            base = found.get(base_name)
            if not isinstance(base, float):
                continue
            xs = [found.get(name) for name in others]
            lines.append(f"| {ranks} | {crash} | {base:.3f} | " + " | ".join(
                f"{x / base:.1f}x" if isinstance(x, float) else "n/a" for x in xs) + " |")
        if lines:
            print(f"\n| ranks | crash | {base_name} median s | "
                  + " | ".join(f"x vs {name}" for name in others) + " |")
            print("|---|---|---|" + "---|" * len(others))
            print("\n".join(lines))


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


def import_table(results: list[dict[str, object]]) -> None:
    """The fork server's import time in each of our cells that has one."""
    rows = [r for r in results if r.get("import_first_s") is not None]
    if not rows:
        return
    print("\n| ranks | crash | launcher | fork server import, first server (median s) |"
          " later servers (median s, count) |")
    print("|---|---|---|---|---|")
    for r in rows:
        later = r.get("import_later_s")
        print(f"| {r['ranks']} | {r['crash']} | {r['launcher']} | {r['import_first_s']:.2f} | "
              + (f"{later:.2f} ({r['imports_later_n']}) |" if isinstance(later, float)
                 else "- |"))


def first_attempts(a: argparse.Namespace) -> list[dict[str, object]]:
    """Launch -> first step on every rank, ours cold against forked, runs alternated."""
    rows: list[dict[str, object]] = []
    if a.first_attempt_runs <= 0:
        return rows
    launchers = {"ours cold (no --preload)": Cell("first cold", "ours"),
                 "ours forked (--preload torch,torch._dynamo)": Cell("first forked", "ours",
                                                                     LIST)}
    for ranks in (int(r) for r in a.first_attempt_ranks.split(",")):
        times: dict[str, list[float]] = {name: [] for name in launchers}
        imports: list[float] = []
        for run in range(a.first_attempt_runs):
            order = list(launchers.items())
            for name, cell in order if run % 2 == 0 else order[::-1]:
                took, imported = first_attempt_once(cell, ranks)
                if took is not None:
                    times[name].append(took)
                imports += imported
                print(f"  first attempt, {ranks} ranks, {name}: {took}", file=sys.stderr,
                      flush=True)
        for name, values in times.items():
            rows.append({"ranks": ranks, "launcher": name, "n": len(values),
                         "median": median(values), "min": min(values, default=None),
                         "max": max(values, default=None),
                         "import_s": median(imports) if "forked" in name else None})
    return rows


def first_attempt_once(cell: Cell, ranks: int) -> tuple[float | None, list[float]]:
    """One run of a job that does not crash: seconds from the launcher's start to every
    rank's first step (None: not within the timeout), and its fork server's import."""
    root = Path(tempfile.mkdtemp(prefix="first-attempt-"))
    out = root / "out"
    out.mkdir()
    argv = [*command(cell, ranks, 0, root / "logs"), str(JOB), str(out), "--crashes", "0"]
    launched = time.time()
    with open(root / "err", "wb") as err:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=err, env=launcher_env(), cwd=root,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not done(out, ranks, 0) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        took = None
        if done(out, ranks, 0):
            took = max(json.loads((out / f"a0_r{r}.json").read_text())["step"]
                       for r in range(ranks)) - launched
    finally:
        stop_session(proc, 20)
    imports = [float(t) for t in IMPORTED.findall((root / "err").read_text(errors="replace"))]
    shutil.rmtree(root, ignore_errors=True)
    return took, imports


def first_attempt_table(rows: list[dict[str, object]]) -> None:
    if not rows:
        return
    print("\n| ranks | launcher | runs | launch -> first step on every rank, median s |"
          " min-max s | fork server import, median s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        med, low, high, imp = r["median"], r["min"], r["max"], r["import_s"]
        print(f"| {r['ranks']} | {r['launcher']} | {r['n']} | "
              + (f"{med:.2f} | {low:.2f}-{high:.2f} |" if isinstance(med, float)
                 and isinstance(low, float) and isinstance(high, float) else "- | - |")
              + (f" {imp:.2f} |" if isinstance(imp, float) else " - |"))


if __name__ == "__main__":
    sys.exit(main())
