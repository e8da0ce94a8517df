"""Run every side-by-side benchmark against torchrun and write docs/benchmarks.md.

    python benchmarks/report.py                   # full report, about 12-15 minutes on 2 cores
    python benchmarks/report.py --quick           # smoke run of the same pipeline, a few minutes
    python benchmarks/report.py --only recovery   # rerun one section, keep the others as they are

Each benchmark is its own script (see benchmarks/README.md) and measures elastic-supervisor
and torchrun in the same run; this driver runs them one after the other, keeps their
Markdown tables, and draws PNG plots of the distributions side by side (matplotlib, the
optional ``plots`` extra; without it the report has tables only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import HERE, REPO, log

DOCS = REPO / "docs"


@dataclass
class Section:
    name: str  # for --only
    title: str
    script: str
    args: list[str]
    quick_args: list[str]
    json_flag: bool = True
    text: str = ""
    seconds: float = 0.0
    data: object = None


def sections(quick: bool) -> list[Section]:
    return [
        Section("latency", "Restart latency, launch latency, RSS, idle CPU", "run_all.py", [],
                ["--quick"]),
        Section("output", "Worker output: throughput and integrity", "log_throughput.py",
                ["--repeat", "3"], ["--repeat", "1", "--lines", "50000"], json_flag=False),
        Section("hang", "Hang detection (deadline FIFO)", "hang_bench.py", ["--runs", "30"],
                ["--runs", "4"]),
        Section("health", "Health endpoint under load", "health_under_load.py",
                ["--duration", "20"], ["--duration", "5"]),
        Section("recovery", "Recovery of a real DDP job (crash -> first step of the next attempt)",
                "recovery.py", ["--reps", "10"],
                ["--reps", "2", "--ranks", "2", "--crashes", "exit", "--torchrun-runs", "3",
                 "--busy-runs", "1", "--first-attempt-runs", "1"]),
        Section("state", "Training state after a failure: torch.save vs snapshots",
                "state_recovery.py", ["--ranks", "2,4"], ["--ranks", "2"]),
        Section("rendezvous", "Rendezvous and scale-up (etcd vs torchrun c10d)",
                "rendezvous_bench.py",
                ["--reps", "1", "--sizes", "2,4,8,16", "--scale-window", "5",
                 "--loss-window", "5"], ["--quick"], json_flag=False),
    ]


def run(section: Section, quick: bool, workdir: Path) -> None:
    script = HERE / section.script
    if not script.exists():
        section.text = f"_{section.script} is not available in this checkout._"
        return
    args = [*(section.quick_args if quick else section.args)]
    json_path = workdir / f"{script.stem}.json"
    if section.json_flag:
        args += ["--json", str(json_path)]
    log(f"== {section.script} {' '.join(args)}")
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(script), *args], capture_output=True,
                            text=True, cwd=HERE.parent, timeout=4 * 3600)
    section.seconds = time.monotonic() - started
    section.text = result.stdout.strip() or "_no output_"
    if result.returncode != 0:
        section.text += f"\n\n_exit code {result.returncode}:_\n```\n{result.stderr[-1500:]}\n```"
    if json_path.exists():
        section.data = json.loads(json_path.read_text())


def plot(sections_run: list[Section], out: Path) -> list[str]:
    """Bar charts of medians with min-max ranges, ours next to torchrun's."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    images: list[str] = []
    for section in sections_run:
        if section.script == "run_all.py" and isinstance(section.data, dict):
            images += _plot_run_all(plt, section.data, out)
        if section.script == "hang_bench.py" and isinstance(section.data, dict):
            images += _plot_hang(plt, section.data, out)
    return images


# (benchmark, metric) -> (title, unit, scale from the raw value)
PLOTTED = {
    ("crash", "first_up"): ("crash -> first restarted worker running", "ms", 1e3),
    ("crash", "all_up"): ("crash -> whole restarted group running", "ms", 1e3),
    ("launch", "first_line"): ("launch -> first worker's first line", "ms", 1e3),
    ("launch", "job_exit"): ("launch -> job exit", "ms", 1e3),
    ("idle", "rss_all"): ("RSS, launcher + helpers", "MiB", 1 / 2**20),
    ("idle", "uss_all"): ("USS, launcher + helpers", "MiB", 1 / 2**20),
}


def _plot_run_all(plt: object, data: dict[str, object], out: Path) -> list[str]:
    rows: list[tuple[str, str, dict[str, float]]] = []
    for bench, entries in data.items():
        if not isinstance(entries, list):
            continue
        for entry in entries:
            if not isinstance(entry, dict):
                continue
            for metric, value in entry.items():
                known = PLOTTED.get((bench, metric))
                if known and isinstance(value, dict) and {"median", "low", "high"} <= value.keys():
                    scaled = {k: float(value[k]) * known[2] for k in ("median", "low", "high")}
                    rows.append((f"{known[0]} ({known[1]})", str(entry.get("launcher")), scaled))
    if not rows:
        return []
    metrics = sorted({r[0] for r in rows})
    fig, axes = plt.subplots(len(metrics), 1, figsize=(8, 2.2 * len(metrics)))  # type: ignore[attr-defined]
    axes = axes if len(metrics) > 1 else [axes]
    for ax, metric in zip(axes, metrics, strict=True):
        entries = [(launcher, v) for m, launcher, v in rows if m == metric]
        names = [e[0] for e in entries]
        med = [e[1]["median"] for e in entries]
        err = [[e[1]["median"] - e[1]["low"] for e in entries],
               [e[1]["high"] - e[1]["median"] for e in entries]]
        ax.barh(names, med, xerr=err, color=["tab:green" if "elastic" in n else "tab:gray"
                                              for n in names])
        ax.set_title(metric + ": median, min-max")
    fig.tight_layout()
    path = out / "benchmarks-latency.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)  # type: ignore[attr-defined]
    return [path.name]


def _plot_hang(plt: object, data: dict[str, object], out: Path) -> list[str]:
    raw = data.get("late_s")
    if not isinstance(raw, dict):
        return []
    fig, ax = plt.subplots(figsize=(7, 3))  # type: ignore[attr-defined]
    labels, samples = [], []
    for name, values in raw.items():
        labels.append(name)
        samples.append([v * 1e3 for v in values if v is not None])
    ax.boxplot(samples, orientation="horizontal")
    ax.set_yticks(range(1, len(labels) + 1), labels)
    ax.set_xlabel("deadline -> hung worker dead (ms)")
    ax.set_title("Hang detection lateness")
    fig.tight_layout()
    path = out / "benchmarks-hang.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)  # type: ignore[attr-defined]
    return [path.name]


def _section_text(section: Section) -> list[str]:
    return [f"## {section.title}", "",
            f"`python benchmarks/{section.script}` ({section.seconds:.0f} s)", "",
            section.text, ""]


def replace_sections(sections_run: list[Section], path: Path) -> None:
    """Put each section's new text where its ``## title`` stands in ``path`` (appended when
    the report has no such section yet); every other section stays as it was."""
    text = path.read_text() if path.exists() else "# Benchmarks: elastic-supervisor vs torchrun\n"
    for section in sections_run:
        heading = f"## {section.title}\n"
        new = "\n".join(_section_text(section))
        start = text.find(heading)
        if start < 0:
            text = text.rstrip("\n") + "\n\n" + new
            continue
        end = text.find("\n## ", start + len(heading))
        text = text[:start] + new + ("\n" + text[end + 1:] if end >= 0 else "")
    path.write_text(text)


def write(sections_run: list[Section], images: list[str], quick: bool, path: Path) -> None:
    load = os.getloadavg()
    head = [
        "# Benchmarks: elastic-supervisor vs torchrun",
        "",
        f"Generated by `python benchmarks/report.py{' --quick' if quick else ''}` on "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC: {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, load average at the end "
        f"{load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}. Every figure is measured for both "
        "launchers in the same run; compare the ratios, absolute numbers drift with the "
        "machine's load. Each section says how to reproduce it alone.",
        "",
    ]
    body: list[str] = []
    for section in sections_run:
        body += _section_text(section)
    plots = [f"![{name}]({name})" for name in images]
    path.write_text("\n".join([*head, *plots, "", *body]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=DOCS / "benchmarks.md")
    parser.add_argument("--only", default="",
                        help="comma-separated section names to rerun in place: "
                             + ", ".join(s.name for s in sections(False)))
    args = parser.parse_args()
    chosen = sections(args.quick)
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {s.name for s in chosen}
        if unknown:
            parser.error(f"unknown section(s): {', '.join(sorted(unknown))}")
        chosen = [s for s in chosen if s.name in wanted]
    with tempfile.TemporaryDirectory(prefix="bench-report-") as tmp:
        for section in chosen:
            run(section, args.quick, Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.only:
        replace_sections(chosen, args.out)
        print(f"updated {args.out}: {', '.join(s.title for s in chosen)}")
        return 0
    images = plot(chosen, args.out.parent)
    write(chosen, images, args.quick, args.out)
    print(f"wrote {args.out} ({sum(s.seconds for s in chosen):.0f} s of benchmarks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
