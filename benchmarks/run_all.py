"""Run every side-by-side benchmark (elastic-supervisor vs torchrun) and print one table.

    python benchmarks/run_all.py --quick                 # smoke run, about a minute
    python benchmarks/run_all.py                         # full run, a few minutes
    python benchmarks/run_all.py --write-docs --note "quiet machine"   # also docs/benchmarks.md

Each figure is measured for both launchers in the same run, alternating their order, so
the ratio holds even on a busy machine where absolute numbers drift. Progress goes to
stderr, the Markdown table to stdout; ``--json FILE`` keeps the raw summaries.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks import crash_restart, idle_footprint, launch_latency
from benchmarks.harness import OURS, TORCHRUN, TORCHRUN_FAST, Summary

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"

# the targets of issue 2 (for our supervisor)
CRASH_TARGET = 0.015  # s, median crash -> first restarted worker
LAUNCH_TARGET = 0.200  # s, median launch -> first worker's first line
RSS_TARGET = 45e6  # bytes (decimal MB)
CPU_RATIO_TARGET = 10.0  # torchrun's idle CPU / ours
TICK = 0.01  # s, psutil's CPU time resolution (clock ticks)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ formatting


def ms(s: Summary) -> str:
    return f"{s.median * 1e3:.1f} ms ({s.low * 1e3:.1f}-{s.high * 1e3:.1f})"


def mib(s: Summary) -> str:
    """MiB (what ps and psutil users usually quote), with decimal MB for the target."""
    text = f"{s.median / 2**20:.1f} MiB = {s.median / 1e6:.1f} MB"
    if f"{s.low / 2**20:.1f}" == f"{s.high / 2**20:.1f}":
        return text
    return f"{text} ({s.low / 2**20:.1f}-{s.high / 2**20:.1f} MiB)"


def cpu(s: Summary) -> str:
    if f"{s.low * 1e3:.1f}" == f"{s.high * 1e3:.1f}":
        return f"{s.median * 1e3:.1f} ms"
    return f"{s.median * 1e3:.1f} ms ({s.low * 1e3:.1f}-{s.high * 1e3:.1f})"


def ratio(theirs: float, ours: float) -> str:
    return f"{theirs / ours:.1f}x" if ours > 0 else "∞"


def cpu_ratio(theirs: Summary, ours: Summary) -> str:
    """Ratio of medians; at 0 psutil ticks ours is only bounded (< 1 tick)."""
    if ours.median == 0 and theirs.median > 0:
        return f"≥ {theirs.median / TICK:.0f}x (ours < 1 tick)"
    return ratio(theirs.median, ours.median)


def cpu_verdict(theirs: Summary, ours: Summary, resolution: float) -> str:
    if ours.median == 0 and resolution:
        return "yes" if theirs.median >= CPU_RATIO_TARGET * resolution else "n/a (< 1 tick)"
    return verdict(theirs.median >= CPU_RATIO_TARGET * ours.median)


def verdict(ok: bool) -> str:
    return "yes" if ok else "**no**"


# ------------------------------------------------------------------ the table


def table(res: dict[str, Any], cfg: argparse.Namespace) -> str:
    rows = ["| benchmark | elastic-supervisor | torchrun | torchrun / ours | target | met |",
            "|---|---|---|---|---|---|"]
    if "crash" in res:
        by = {r.launcher: r for r in res["crash"]}
        ours, tr = by[OURS.name], by[TORCHRUN.name]
        n = ours.first_up.n
        rows.append(
            f"| crash → first restarted worker running ({cfg.workers} workers, {n} restarts) "
            f"| {ms(ours.first_up)} | {ms(tr.first_up)} "
            f"| {ratio(tr.first_up.median, ours.first_up.median)} "
            f"| ≤ 15 ms | {verdict(ours.first_up.median <= CRASH_TARGET)} |")
        if TORCHRUN_FAST.name in by:
            fast = by[TORCHRUN_FAST.name]
            rows.append(
                f"| … same, torchrun `--monitor-interval 0.01` | {ms(ours.first_up)} "
                f"| {ms(fast.first_up)} | {ratio(fast.first_up.median, ours.first_up.median)} "
                "| | |")
        rows.append(
            f"| crash → whole restarted group running | {ms(ours.all_up)} | {ms(tr.all_up)} "
            f"| {ratio(tr.all_up.median, ours.all_up.median)} | | |")
        rows.append(
            f"| launcher CPU per restart (+ helpers; CPU clock) | {cpu(ours.cpu_per_restart)} "
            f"| {cpu(tr.cpu_per_restart)} "
            f"| {ratio(tr.cpu_per_restart.median, ours.cpu_per_restart.median)} | | |")
        if TORCHRUN_FAST.name in by:
            fast = by[TORCHRUN_FAST.name]
            rows.append(
                f"| … same, torchrun `--monitor-interval 0.01` | {cpu(ours.cpu_per_restart)} "
                f"| {cpu(fast.cpu_per_restart)} "
                f"| {ratio(fast.cpu_per_restart.median, ours.cpu_per_restart.median)} | | |")
    if "launch" in res:
        by = {r.launcher: r for r in res["launch"]}
        ours, tr, bare = by[OURS.name], by[TORCHRUN.name], by["no launcher"]
        n = ours.first_line.n
        rows.append(
            f"| launch → first worker's first line ({cfg.workers} workers, {n} reps) "
            f"| {ms(ours.first_line)} | {ms(tr.first_line)} "
            f"| {ratio(tr.first_line.median, ours.first_line.median)} "
            f"| ≤ 200 ms | {verdict(ours.first_line.median <= LAUNCH_TARGET)} |")
        rows.append(
            f"| launch → job exit (every worker exits 0 at once) | {ms(ours.job_exit)} "
            f"| {ms(tr.job_exit)} | {ratio(tr.job_exit.median, ours.job_exit.median)} | | |")
        rows.append(
            f"| floor: no launcher, {cfg.workers} x `Popen` → first line "
            f"| {ms(bare.first_line)} | | | | |")
    if "idle" in res:
        by = {r.launcher: r for r in res["idle"]}
        ours, tr = by[OURS.name], by[TORCHRUN.name]
        w = f"{cfg.idle_workers} idle workers"
        rows += [
            f"| RSS, supervisor process ({w}) | {mib(ours.rss)} | {mib(tr.rss)} "
            f"| {ratio(tr.rss.median, ours.rss.median)} | ≤ 45 MB "
            f"| {verdict(ours.rss.median <= RSS_TARGET)} |",
            f"| RSS, supervisor + guardian | {mib(ours.rss_all)} | {mib(tr.rss_all)} "
            f"| {ratio(tr.rss_all.median, ours.rss_all.median)} | ≤ 45 MB "
            f"| {verdict(ours.rss_all.median <= RSS_TARGET)} |",
            f"| USS (memory no other process shares), supervisor + guardian "
            f"| {mib(ours.uss_all)} | {mib(tr.uss_all)} "
            f"| {ratio(tr.uss_all.median, ours.uss_all.median)} | | |",
        ]
        win = f"{ours.window:.0f} s"
        rows += [
            f"| CPU over {win}, {w}, supervisor (psutil user+sys) | {cpu(ours.cpu)} "
            f"| {cpu(tr.cpu)} | {cpu_ratio(tr.cpu, ours.cpu)} | | |",
            f"| CPU over {win}, supervisor + guardian (psutil) | {cpu(ours.cpu_all)} "
            f"| {cpu(tr.cpu_all)} | {cpu_ratio(tr.cpu_all, ours.cpu_all)} | ≥ 10x lower "
            f"| {cpu_verdict(tr.cpu_all, ours.cpu_all, TICK)} |",
            f"| CPU over {win}, supervisor + guardian (process CPU clock, ns) "
            f"| {cpu(ours.sched_all)} | {cpu(tr.sched_all)} "
            f"| {cpu_ratio(tr.sched_all, ours.sched_all)} | ≥ 10x lower "
            f"| {cpu_verdict(tr.sched_all, ours.sched_all, 0.0)} |",
        ]
    if "standby" in res:
        sb = res["standby"]
        n = int(sb["count"])
        rows.append(
            f"| with `--max-restarts` ≥ 1: {n} standby interpreters (warm restarts), RSS "
            f"(USS) | {sb['rss'] / 2**20:.1f} MiB ({sb['uss'] / 2**20:.1f} MiB), "
            f"{sb['rss'] / max(n, 1) / 2**20:.1f} MiB each | | | | |")
        rows.append(
            f"| … supervisor process RSS alongside them "
            f"| {sb['supervisor_rss'] / 2**20:.1f} MiB | | | | |")
    out = "\n".join(rows)
    notes = []
    if "crash" in res:
        notes.append(
            "Our restarts are warm (docs/design.md, *standby*): each local rank's next worker "
            "runs in an interpreter started while the previous attempt ran. \"Launcher CPU "
            "per restart\" leaves out that interpreter's start-up, as it leaves out the "
            "start-up of torchrun's workers: it is the worker's own, paid once per worker "
            "by both launchers.")
    if "launch" in res or "crash" in res:
        notes.append(
            "Our package's bytecode is compiled before the run (`harness.ensure_bytecode`), "
            "as `pip install` does for a regular install and as torch's is.")
    out += "".join(f"\n\n{n}" for n in notes)
    phases = _phase_table(res)
    return out + ("\n\n" + phases if phases else "")


def _phase_table(res: dict[str, Any]) -> str:
    crash = {r.launcher: r for r in res.get("crash", [])}.get(OURS.name)
    launch = {r.launcher: r for r in res.get("launch", [])}.get(OURS.name)
    rows = ["Where our time goes, phase by phase (the supervisor's `events.jsonl` against the "
            "workers' records; medians, range):", "", "| phase | time |", "|---|---|"]
    labels = {
        "detect": "restart: crash → supervisor notices the exit (pidfd)",
        "stop": "restart: → rest of the group stopped, swept and reaped",
        "first_line": "restart: → first worker's first line (rendezvous, spawn, "
                      "interpreter start-up)",
        "spawn_all": "restart: (group stopped → all N workers spawned; overlaps the above)",
    }
    n = len(rows)
    if crash is not None and crash.phases:
        rows += [f"| {label} | {ms(crash.phases[k])} |" for k, label in labels.items()
                 if k in crash.phases]
    labels = {
        "startup": "launch: spawn → supervisor's first event (interpreter, imports, set-up)",
        "first_line": "launch: → first worker's first line (rendezvous, spawn, "
                      "interpreter start-up)",
        "spawn_all": "launch: (first event → all N workers spawned; overlaps the above)",
    }
    if launch is not None and launch.phases:
        rows += [f"| {label} | {ms(launch.phases[k])} |" for k, label in labels.items()
                 if k in launch.phases]
    return "\n".join(rows) if len(rows) > n else ""


# ------------------------------------------------------------------ the docs


def machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch  # only for its version; this takes a moment

        torch_version = torch.__version__
    except Exception:  # torch missing or broken: say so, go on
        torch_version = "?"
    return (f"{os.cpu_count()} cores ({model or 'unknown CPU'}), Linux {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch_version}")


def results_section(md: str, cfg: argparse.Namespace, load: tuple[tuple[float, ...], ...],
                    seconds: float) -> str:
    today = dt.date.today().isoformat()
    before, after = (" / ".join(f"{x:.1f}" for x in la) for la in load)
    command = "python benchmarks/run_all.py " + " ".join(_shown_args(cfg.argv))
    lines = [
        START,
        f"Measured {today} on {machine()}.",
        "",
        f"Command: `{command.strip()}` ({seconds:.0f} s). "
        f"Load average (1/5/15 min) before: {before}; after: {after}.",
    ]
    if cfg.note:
        lines += ["", f"**Note:** {cfg.note}"]
    lines += ["", "Medians, with the range (min-max) in parentheses.", "", md, END]
    return "\n".join(lines)


def _shown_args(argv: list[str]) -> list[str]:
    """The arguments that change what is measured (not --note, --json, --write-docs)."""
    shown, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in ("--note", "--json"):
            skip = True
            continue
        if arg.startswith(("--note=", "--json=")) or arg == "--write-docs":
            continue
        shown.append(arg)
    return shown


DOC_TEMPLATE = """# Benchmarks: elastic-supervisor vs torchrun

How these are measured, and how to reproduce them: `benchmarks/README.md`.

## Latest results

{section}
"""


def write_docs(section: str) -> None:
    if DOCS.exists():
        text = DOCS.read_text()
        if START in text and END in text:
            pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
            DOCS.write_text(pattern.sub(lambda _: section, text, count=1))
            return
        DOCS.write_text(text.rstrip() + "\n\n## Latest results\n\n" + section + "\n")
        return
    DOCS.write_text(DOC_TEMPLATE.format(section=section))


# ------------------------------------------------------------------ main


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="short smoke run (few samples)")
    p.add_argument("--only", action="append", choices=["crash", "launch", "idle"],
                   help="run only these benchmarks (repeatable)")
    p.add_argument("--workers", type=int, default=4, help="workers for crash and launch")
    p.add_argument("--crash-restarts", type=int, help="restarts per crash run (30; quick 5)")
    p.add_argument("--crash-runs", type=int, help="crash runs per launcher (2; quick 1)")
    p.add_argument("--no-fast", action="store_true", help="skip torchrun --monitor-interval 0.01")
    p.add_argument("--launch-reps", type=int, help="launches per launcher (10; quick 3)")
    p.add_argument("--idle-workers", type=int, default=8)
    p.add_argument("--idle-window", type=float, help="CPU window in seconds (20; quick 3)")
    p.add_argument("--idle-settle", type=float, help="seconds after start-up (3; quick 1)")
    p.add_argument("--idle-reps", type=int, help="idle runs per launcher (2; quick 1)")
    p.add_argument("--json", help="also write the raw summaries here")
    p.add_argument("--write-docs", action="store_true", help=f"replace the results in {DOCS.name}")
    p.add_argument("--note", help="a line to print with the results (e.g. 'shared machine')")
    ns = p.parse_args(argv)
    q = ns.quick
    defaults = {"crash_restarts": (30, 5), "crash_runs": (2, 1), "launch_reps": (10, 3),
                "idle_window": (20.0, 3.0), "idle_settle": (3.0, 1.0), "idle_reps": (2, 1)}
    for key, (full, quick) in defaults.items():
        if getattr(ns, key) is None:
            setattr(ns, key, quick if q else full)
    ns.argv = argv
    return ns


def main(argv: list[str] | None = None) -> int:
    cfg = parse(sys.argv[1:] if argv is None else argv)
    only = set(cfg.only or ["crash", "launch", "idle"])
    load_before = os.getloadavg()
    started = time.monotonic()
    res: dict[str, Any] = {}
    if "launch" in only:
        log(f"launch latency: {cfg.launch_reps} reps x {cfg.workers} workers")
        res["launch"] = launch_latency.measure(
            [OURS, TORCHRUN], reps=cfg.launch_reps, workers=cfg.workers, log=log)
    if "crash" in only:
        launchers = [OURS, TORCHRUN] + ([] if cfg.no_fast else [TORCHRUN_FAST])
        log(f"crash -> restart: {cfg.crash_runs} run(s) x {cfg.crash_restarts} restarts")
        res["crash"] = crash_restart.measure(
            launchers, restarts=cfg.crash_restarts, runs=cfg.crash_runs, workers=cfg.workers,
            log=log)
    if "idle" in only:
        log(f"idle footprint: {cfg.idle_reps} rep(s), {cfg.idle_workers} workers, "
            f"{cfg.idle_window:.0f} s window")
        res["idle"] = idle_footprint.measure(
            [OURS, TORCHRUN], workers=cfg.idle_workers, window=cfg.idle_window,
            settle=cfg.idle_settle, reps=cfg.idle_reps, log=log)
        res["standby"] = idle_footprint.standby_cost(cfg.idle_workers, cfg.idle_settle)
        log(f"  standbys with --max-restarts 1: {res['standby']}")
    seconds = time.monotonic() - started
    md = table(res, cfg)
    print(md)
    if cfg.json:
        Path(cfg.json).write_text(json.dumps(
            {k: v if isinstance(v, dict) else [asdict(r) for r in v] for k, v in res.items()},
            indent=2))
    if cfg.write_docs:
        write_docs(results_section(md, cfg, (load_before, os.getloadavg()), seconds))
        log(f"wrote {DOCS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
