"""What a failure costs a real job: its state reloaded and its work redone (issue 49).

    python benchmarks/state_recovery.py [--ranks 2,4] [--reps 1] [--json FILE]
                                        [--only NAMES] [--long [--duration S --every S]]

The job is ``benchmarks/state_job.py``: DDP (gloo, CPU, one thread per rank), 64 MiB of
parameters and Adam (192 MiB of state per rank); rank 1 exits 3 right after step 35 of
attempt 0; the job trains 50 steps. Cases, side by side in one run (alternated between
repetitions):

- (a) ``torchrun --standalone``, ``torch.save`` of the state every 20 steps (rank 0, between
  barriers) and a restart that resumes from the file: steps 21-35 are redone;
- (b) the same job under elastic-supervisor with ``--preload torch,torch._dynamo``;
- (c) ``supervisor.snapshot.save(state, step)`` every step under elastic-supervisor with
  ``--preload``, per rank and with ``replicated=True``; the restart resumes from
  ``snapshot.load()``.

A reference run of the same job without a failure (torchrun, no saves) gives the losses
every case must reproduce **bit for bit** after its restart (each rank's loss of each
step, ``float.hex``). Figures, from the workers' own wall-clock records: crash -> first
step of the next attempt that trains (every rank); crash -> back at the crash's step (every
rank holds the state of step 35 again: restored, or recomputed); the step each rank
restored and the steps redone; the stall per save (everything ``save()`` or the checkpoint
block does before it returns, every rank, every save: median and p99); the shared memory
the supervisor's snapshot regions take (their allocated pages in its directory under
/dev/shm, the highest seen while the job runs); the ratio (c)/(b).

``--long``: a failure every ``--every`` s (120) for ``--duration`` s (1200) in (b) and
(c), and the same job without failures and without saves; goodput = the step (b) or (c)
had reached at the end / the step the reference had reached. About ``4 x duration``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness import BIN, HERE, ensure_bytecode, launcher_env, log, stop_session

JOB = HERE / "state_job.py"
PRELOAD = ("--preload", "torch,torch._dynamo")
CRASH_STEP = 35
STEPS = 50
RESTARTS = 3  # a failed restart (torchrun's often are) gets another go
PHASES = ("launch", "set-up", "load", "redo")
RECOVERY_TIMEOUT = 300.0  # s after the crash without the next attempt training: not recovered


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # ours | torchrun
    mode: str  # state_job.py --mode


CASES = (
    Case("(a) torchrun, torch.save every 20", "torchrun", "torchsave"),
    Case("(b) ours --preload, torch.save every 20", "ours", "torchsave"),
    Case("(c) ours --preload, snapshot.save every step", "ours", "snapshot"),
    Case("(c) ours --preload, snapshot.save replicated", "ours", "replicated"),
)
REFERENCE = Case("reference: no failure, no saves", "torchrun", "none")


def command(case: Case, ranks: int, logs: Path, restarts: int) -> list[str]:
    common = ["--nproc-per-node", str(ranks), "--max-restarts", str(restarts),
              "--log-dir", str(logs)]
    if case.kind == "ours":
        ensure_bytecode()
        exe = BIN / "elastic-supervisor"
        head = [str(exe), "run"] if exe.exists() else [sys.executable, "-m", "supervisor", "run"]
        return [*head, "--standalone", "--nnodes", "1", *common, "--health-port", "0", *PRELOAD]
    exe = BIN / "torchrun"
    head = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [*head, "--standalone", "--nnodes", "1", *common]


# ------------------------------------------------------------------ one run


@dataclass
class Run:
    """One launcher run of the job, its records parsed."""

    case: Case
    ranks: int
    records: dict[int, list[dict[str, object]]] = field(default_factory=dict)  # by rank
    crashes: list[float] = field(default_factory=list)  # wall clock of crash k
    shm_peak: int | None = None  # bytes, the supervisor's snapshot regions at their highest
    exit_code: int | None = None
    seconds: float = 0.0


def launch(case: Case, ranks: int, job_args: list[str], deadline_s: float,
           stop_when: Callable[[], bool] | None = None, restarts: int = RESTARTS) -> Run:
    """Run the case until the launcher exits, ``stop_when()`` is true or the deadline."""
    root = Path(tempfile.mkdtemp(prefix="state-recovery-"))
    out = root / "out"
    out.mkdir()
    argv = [*command(case, ranks, root / "logs", restarts), str(JOB), str(out), "--mode", case.mode,
            *job_args]
    run = Run(case, ranks)
    started = time.monotonic()
    with open(root / "err", "wb") as err:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=err, env=launcher_env(), cwd=root,
                                start_new_session=True)
    sampler = ShmSampler(proc.pid) if case.kind == "ours" else None
    try:
        while proc.poll() is None and time.monotonic() - started < deadline_s:
            if stop_when is not None and stop_when():
                break
            if not_recovering(out):
                break
            time.sleep(0.2)
    finally:
        if sampler is not None:
            run.shm_peak = sampler.stop()
        stop_session(proc)
    run.exit_code = proc.returncode
    run.seconds = time.monotonic() - started
    for path in out.glob("r*.jsonl"):
        rank = int(path.stem[1:])
        run.records[rank] = [json.loads(line) for line in path.read_text().splitlines()
                             if line.strip()]
    for path in sorted(out.glob("crash_*"), key=lambda p: int(p.name.split("_")[1])):
        run.crashes.append(float(path.read_text()))
    if os.environ.get("BENCH_KEEP"):
        log(f"kept {root}")
    else:
        subprocess.run(["rm", "-rf", str(root)], check=False)
    return run


def not_recovering(out: Path) -> bool:
    """The last crash went RECOVERY_TIMEOUT s without a later attempt training."""
    crashes = sorted(out.glob("crash_*"))
    if not crashes:
        return False
    last = max(crashes, key=lambda p: p.stat().st_mtime)
    attempt = int(last.name.split("_")[1])
    for path in out.glob("r*.jsonl"):
        with contextlib.suppress(OSError):
            if f'"a": {attempt + 1}' in path.read_text() and '"ev": "step"' in path.read_text():
                return False
    return time.time() - last.stat().st_mtime > RECOVERY_TIMEOUT


SHM = Path("/dev/shm")  # the supervisor's --snapshot-memory-dir (its default)
REGIONS = "elastic-supervisor-snapshots-{pid}-*"  # its private directory of regions


class ShmSampler:
    """The shared memory the supervisor's snapshot regions take (their allocated pages,
    in its private directory under /dev/shm), every 0.25 s: the highest."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak: int | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._done.wait(0.25):
            total = 0
            for directory in SHM.glob(REGIONS.format(pid=self.pid)):
                with contextlib.suppress(OSError):
                    for entry in os.scandir(directory):
                        with contextlib.suppress(OSError):
                            total += entry.stat(follow_symlinks=False).st_blocks * 512
            self.peak = max(self.peak or 0, total)

    def stop(self) -> int | None:
        self._done.set()
        self._thread.join(5)
        return self.peak


# ------------------------------------------------------------------ figures of a run


def events(run: Run, ev: str, attempt: int | None = None) -> dict[int, list[dict[str, object]]]:
    return {rank: [r for r in recs if r["ev"] == ev and (attempt is None or r["a"] == attempt)]
            for rank, recs in run.records.items()}


def losses(run: Run, attempt: int | None = None) -> dict[tuple[int, int], str]:
    """(rank, step) -> loss (hex), of one attempt or (later attempts winning) all."""
    found: dict[tuple[int, int], str] = {}
    for rank, steps in events(run, "step", attempt).items():
        for r in sorted(steps, key=lambda r: int(str(r["a"]))):
            found[(rank, int(str(r["step"])))] = str(r["loss"])
    return found


def recovery(run: Run) -> dict[str, object] | None:
    """The figures of the first crash's recovery, None if the job never trained again."""
    if not run.crashes:
        return None
    t_crash = run.crashes[0]
    attempts = sorted({int(str(r["a"])) for recs in run.records.values() for r in recs
                       if r["ev"] == "step" and int(str(r["a"])) > 0})
    for attempt in attempts:
        steps = events(run, "step", attempt)
        if len(steps) != run.ranks or not all(steps.values()):
            continue  # a restart that failed before every rank stepped (torchrun's)
        restores = {rank: recs[0] for rank, recs in events(run, "restore", attempt).items()
                    if recs}
        first = max(min(float(str(r["t"])) for r in recs) for recs in steps.values())
        back: list[float] = []
        for rank, recs in steps.items():
            restored = restores.get(rank, {}).get("step", 0)
            if isinstance(restored, int) and restored >= CRASH_STEP:
                back.append(float(str(restores[rank]["t1"])))
            else:
                back += [float(str(r["t"])) for r in recs if r["step"] == CRASH_STEP]
        restored_steps = sorted({int(str(r.get("step", 0))) for r in restores.values()})
        starts = [float(str(recs[0]["t"])) for recs in events(run, "start", attempt).values()
                  if recs]
        # the latest rank at each boundary: crash -> its script runs (the launcher) ->
        # its load starts (interpreter, import torch, init_process_group, the model) ->
        # its load ends -> back at the crash's step (steps redone)
        phases = {
            "launch": max(starts) - t_crash if len(starts) == run.ranks else None,
            "set-up": max(float(str(r["t0"])) for r in restores.values()) - max(starts)
            if restores and starts else None,
            "load": max(float(str(r["t1"])) - float(str(r["t0"])) for r in restores.values())
            if restores else None,
            "redo": max(back) - max(float(str(r["t1"])) for r in restores.values())
            if restores and len(back) == run.ranks else None,
        }
        return {
            "phases": phases,
            "attempt": attempt,
            "first_step_s": first - t_crash,
            "back_s": max(back) - t_crash if len(back) == run.ranks else None,
            "restored": restored_steps,
            "source": sorted({str(r.get("source")) for r in restores.values()}),
            "redone": CRASH_STEP - min(restored_steps) if restored_steps else None,
            "load_s": max(float(str(r["t1"])) - float(str(r["t0"])) for r in restores.values())
            if restores else None,
        }
    return None


def saves(run: Run) -> tuple[list[float], list[bool], int | None]:
    """Every save's stall (s), whether each was kept, the state's bytes per rank."""
    found = [r for recs in events(run, "save").values() for r in recs]
    size = max((int(str(r["bytes"])) for r in found if "bytes" in r), default=None)
    return [float(str(r["dt"])) for r in found], [bool(r["ok"]) for r in found], size


def step_time(run: Run) -> float | None:
    """The median time between two steps of attempt 0 (a step and its save), rank 0."""
    ts = sorted(float(str(r["t"])) for r in events(run, "step", 0).get(0, []))
    gaps = [b - a for a, b in itertools.pairwise(ts[5:])]  # past the warm-up
    return statistics.median(gaps) if gaps else None


def bit_for_bit(run: Run, reference: dict[tuple[int, int], str]) -> tuple[bool, int]:
    """Whether every loss of every attempt equals the reference's; how many compared."""
    compared = 0
    for rank, steps in events(run, "step").items():
        for r in steps:
            key = (rank, int(str(r["step"])))
            if key in reference:
                compared += 1
                if reference[key] != r["loss"]:
                    return False, compared
    return compared > 0, compared


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarise(case: Case, ranks: int, runs: list[Run],
              reference: dict[tuple[int, int], str]) -> dict[str, object]:
    recs = [r for r in (recovery(run) for run in runs) if r is not None]
    stalls: list[float] = []
    kept: list[bool] = []
    size = None
    for run in runs:
        s, k, b = saves(run)
        stalls += s
        kept += k
        size = b or size
    checks = [bit_for_bit(run, reference) for run in runs]

    def med(key: str) -> float | None:
        values = [float(str(r[key])) for r in recs if r.get(key) is not None]
        return statistics.median(values) if values else None

    phases = {name: median([float(str(split[name])) for r in recs
                            if isinstance(split := r["phases"], dict) and split[name] is not None])
              for name in PHASES}
    shm = [run.shm_peak for run in runs if run.shm_peak is not None]
    steps = [t for t in (step_time(run) for run in runs) if t is not None]
    return {
        "ranks": ranks, "case": case.name, "runs": len(runs), "recovered": len(recs),
        "first_step_s": med("first_step_s"), "back_s": med("back_s"),
        "first_step_all": [r["first_step_s"] for r in recs],
        "back_all": [r["back_s"] for r in recs],
        "restored": sorted({s for r in recs for s in r["restored"]}),  # type: ignore[attr-defined]
        "source": sorted({s for r in recs for s in r["source"]}),  # type: ignore[attr-defined]
        "redone": med("redone"), "load_s": med("load_s"), "phases": phases,
        "bit_for_bit": all(ok for ok, _ in checks) and bool(checks),
        "compared": sum(n for _, n in checks),
        "saves": len(stalls), "saves_refused": kept.count(False),
        "stall_median_ms": (statistics.median(stalls) * 1e3) if stalls else None,
        "stall_p99_ms": (percentile(stalls, 0.99) or 0) * 1e3 if stalls else None,
        "step_s": statistics.median(steps) if steps else None,
        "state_mib": size / 2**20 if size else None,
        "shm_mib": max(shm) / 2**20 if shm else None,
        # against the state it keeps: one per rank, or one per node with replicated
        "shm_x": max(shm) / (size * (1 if case.mode == "replicated" else ranks))
        if shm and size else None,
    }


# ------------------------------------------------------------------ the short run


def crash_run(case: Case, ranks: int) -> Run:
    args = ["--steps", str(STEPS), "--crash-step", str(CRASH_STEP)]
    run = launch(case, ranks, args, deadline_s=600)
    log(f"{ranks} ranks, {case.name}: exit {run.exit_code} after {run.seconds:.0f} s, "
        f"recovery {recovery(run)}")
    return run


def short(a: argparse.Namespace) -> list[dict[str, object]]:
    only = set(a.only.split(",")) if a.only else None
    chosen = [c for c in CASES if only is None or any(o in c.name for o in only)]
    rows = []
    for ranks in (int(r) for r in a.ranks.split(",")):
        ref_run = launch(REFERENCE, ranks, ["--steps", str(STEPS), "--crash-step", "-1"],
                         deadline_s=600)
        reference = losses(ref_run)
        log(f"{ranks} ranks, reference: exit {ref_run.exit_code}, {len(reference)} losses")
        runs: dict[Case, list[Run]] = {c: [] for c in chosen}
        for rep in range(a.reps):
            for case in (chosen if rep % 2 == 0 else list(reversed(chosen))):
                runs[case].append(crash_run(case, ranks))
        for case in chosen:
            row = summarise(case, ranks, runs[case], reference)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def fmt(value: object, spec: str = ".2f") -> str:
    return format(value, spec) if isinstance(value, float | int) else "-"


def table(rows: list[dict[str, object]]) -> None:
    print(f"\nCrash after step {CRASH_STEP} of attempt 0 (rank 1 exits 3), {STEPS} steps; "
          "medians over the runs.\n")
    print("| ranks | case | recovered | crash -> first step s | crash -> back at step "
          f"{CRASH_STEP} s | of which: launch, set-up, load, redo s | restored (from) |"
          " steps redone | losses bit for bit |"
          " stall per save median / p99 ms (saves) | step s | state per rank MiB |"
          " snapshot memory MiB (x the state kept) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        restored = ",".join(str(s) for s in r["restored"]) or "-"  # type: ignore[attr-defined]
        source = ",".join(r["source"])  # type: ignore[arg-type]
        bfb = f"{'yes' if r['bit_for_bit'] else 'NO'} ({r['compared']})"
        refused = f", {r['saves_refused']} refused" if r["saves_refused"] else ""
        stall = (f"{fmt(r['stall_median_ms'], '.0f')} / {fmt(r['stall_p99_ms'], '.0f')} "
                 f"({r['saves']}{refused})")
        phases = r["phases"]
        assert isinstance(phases, dict)
        split = ", ".join(fmt(phases[p]) for p in PHASES)
        print(f"| {r['ranks']} | {r['case']} | {r['recovered']}/{r['runs']} | "
              f"{fmt(r['first_step_s'])} | {fmt(r['back_s'])} | {split} | "
              f"{restored} ({source}) | "
              f"{fmt(r['redone'], '.0f')} | {bfb} | {stall} | {fmt(r['step_s'])} | "
              f"{fmt(r['state_mib'], '.0f')} | {fmt(r['shm_mib'], '.0f')} "
              f"({fmt(r['shm_x'], '.1f')}) |")


def ratios(rows: list[dict[str, object]]) -> None:
    print("\nRatio (c)/(b) (below 1: (c) is back sooner).\n")
    print(f"| ranks | case | crash -> first step | crash -> back at step {CRASH_STEP} |")
    print("|---|---|---|---|")
    for ranks in sorted({int(str(r["ranks"])) for r in rows}):
        mine = [r for r in rows if r["ranks"] == ranks]
        base = next((r for r in mine if str(r["case"]).startswith("(b)")), None)
        if base is None:
            continue
        for r in mine:
            if not str(r["case"]).startswith("(c)"):
                continue

            def x(key: str, r: dict[str, object] = r,
                  base: dict[str, object] = base) -> str:
                mine_v, base_v = r[key], base[key]
                if isinstance(mine_v, float) and isinstance(base_v, float) and base_v:
                    return f"{mine_v / base_v:.2f}"
                return "-"

            print(f"| {ranks} | {r['case']} | {x('first_step_s')} | {x('back_s')} |")


# ------------------------------------------------------------------ the long run


def long_run(a: argparse.Namespace) -> list[dict[str, object]]:
    """Goodput of (b) and (c) with a failure every ``--every`` s, against the reference."""
    rows = []
    ranks = int(a.ranks.split(",")[0])
    cases = [REFERENCE, CASES[1], CASES[2]]
    reached: dict[str, int] = {}
    for case in cases:
        t0 = time.time() + 1.0
        crash = ["--crash-every", str(a.every), "--t0", str(t0)] if case is not REFERENCE else []
        args = ["--steps", "0", "--crash-step", "-1", *crash]
        end = t0 + a.duration

        def over(end: float = end) -> bool:
            return time.time() > end

        run = launch(Case(case.name, "ours", case.mode) if case is REFERENCE else case, ranks,
                     args, deadline_s=a.duration + 120, stop_when=over, restarts=1000)
        steps = [int(str(r["step"])) for recs in events(run, "step").values() for r in recs
                 if float(str(r["t"])) <= end]
        reached[case.name] = max(steps, default=0)
        log(f"long, {case.name}: step {reached[case.name]} at {a.duration:.0f} s, "
            f"{len(run.crashes)} failures")
        rows.append({"case": case.name, "ranks": ranks, "failures": len(run.crashes),
                     "step": reached[case.name]})
    ref = reached[REFERENCE.name]
    print(f"\nLong run: {ranks} ranks, {a.duration:.0f} s, a failure every {a.every:.0f} s "
          "(rank 1 exits 3); goodput = the step reached / the step the job reached without "
          "failures and without saves, in the same time.\n")
    print("| case | failures | step reached | goodput |")
    print("|---|---|---|---|")
    for row in rows:
        good = int(str(row["step"])) / ref if ref else 0.0
        row["goodput"] = good
        print(f"| {row['case']} | {row['failures']} | {row['step']} | {good:.1%} |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--reps", type=int, default=1, help="runs of each case per rank count")
    ap.add_argument("--only", default="", help="cases whose name contains one of these "
                                                "comma-separated strings, e.g. '(a),(c)'")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--long", action="store_true")
    ap.add_argument("--duration", type=float, default=1200.0)
    ap.add_argument("--every", type=float, default=120.0)
    a = ap.parse_args()
    if a.long:
        rows = long_run(a)
    else:
        rows = short(a)
        table(rows)
        ratios(rows)
    print(f"\nload average at the end: {'/'.join(f'{v:.1f}' for v in os.getloadavg())} "
          f"on {os.cpu_count()} cores (shared: figures are noisy)")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
