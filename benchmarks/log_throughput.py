"""Worker output throughput: elastic-supervisor vs torchrun's agent vs no agent at all.

Each run starts NPROC workers that ``print()`` LINES numbered lines each (``python -u``),
with both streams teed (``--tee 3``) and the default prefix (``[default0]:``); the console
(the launcher's stdout) goes to a file. The baseline runs the same workers directly, each
writing into its own files. Reported per mode (median of --repeat runs):

- wall: launch to exit of the launcher (or of the last worker for the baseline);
- job CPU: user+sys of the whole process tree (RUSAGE_CHILDREN delta);
- agent CPU: job CPU minus what the workers report for themselves;
- broken: console lines that are not one whole, prefixed worker line;
- console / files: worker lines found on the console and in the per-rank stdout.log files.

Run: ``.venv/bin/python benchmarks/log_throughput.py [--lines 200000] [--repeat 3]``.
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import REPO

TORCHRUN = Path(sys.executable).parent / "torchrun"

WORKER = """\
import os, resource, sys
rank = os.environ.get("RANK", "0")
lines, width, cpu_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
payload = "x" * width
for i in range(lines):
    print(f"rank {rank} line {i} {payload}")
ru = resource.getrusage(resource.RUSAGE_SELF)
with open(os.path.join(cpu_dir, f"cpu.{rank}.{os.getpid()}"), "w") as f:
    f.write(str(ru.ru_utime + ru.ru_stime))
"""

LINE = re.compile(rb"^\[default(\d+)\]:rank (\d+) line \d+ x*$")


@dataclass
class Result:
    wall: float
    job_cpu: float
    worker_cpu: float
    broken: int
    console: int
    files: int

    @property
    def agent_cpu(self) -> float:
        return max(0.0, self.job_cpu - self.worker_cpu)


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def measure(work: Path, launch: Callable[[Path], list[subprocess.Popen[bytes]]]) -> Result:
    """Run one launch in a fresh directory and count what came out."""
    if work.exists():
        shutil.rmtree(work)
    (work / "cpu").mkdir(parents=True)
    cpu0, t0 = children_cpu(), time.monotonic()
    for proc in launch(work):
        proc.wait()
    wall, job_cpu = time.monotonic() - t0, children_cpu() - cpu0
    worker_cpu = sum(float(p.read_text()) for p in (work / "cpu").iterdir())
    broken = console = 0
    console_file = work / "console.out"
    if console_file.exists():
        with console_file.open("rb") as f:
            for raw in f:
                m = LINE.match(raw.rstrip(b"\n"))
                if m and m.group(1) == m.group(2):
                    console += 1
                else:
                    broken += 1
    files = 0
    for path in (work / "logs").glob("**/stdout.log"):
        with path.open("rb") as f:
            files += sum(1 for _ in f)
    return Result(wall, job_cpu, worker_cpu, broken, console, files)


def worker_args(args: argparse.Namespace, work: Path) -> list[str]:
    return [str(work.parent / "worker.py"), str(args.lines), str(args.width), str(work / "cpu")]


def launch_direct(args: argparse.Namespace) -> Callable[[Path], list[subprocess.Popen[bytes]]]:
    """The baseline: each worker writes into its own files, no agent in between."""

    def launch(work: Path) -> list[subprocess.Popen[bytes]]:
        procs = []
        for rank in range(args.nproc):
            rank_dir = work / "logs" / str(rank)
            rank_dir.mkdir(parents=True)
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            with open(rank_dir / "stdout.log", "wb") as out, \
                    open(rank_dir / "stderr.log", "wb") as err:
                procs.append(subprocess.Popen(
                    [sys.executable, "-u", *worker_args(args, work)], stdout=out, stderr=err,
                    env=env,
                ))
        return procs

    return launch


def launch_agent(
    args: argparse.Namespace, argv: Callable[[Path], list[str]]
) -> Callable[[Path], list[subprocess.Popen[bytes]]]:
    """A launcher whose stdout (the console) and stderr go to files."""

    def launch(work: Path) -> list[subprocess.Popen[bytes]]:
        with open(work / "console.out", "wb") as out, open(work / "console.err", "wb") as err:
            return [subprocess.Popen(argv(work), stdout=out, stderr=err, cwd=REPO)]

    return launch


def supervisor_argv(args: argparse.Namespace) -> Callable[[Path], list[str]]:
    def argv(work: Path) -> list[str]:
        return [sys.executable, "-m", "supervisor", "run", "--nproc-per-node", str(args.nproc),
                "--tee", "3", "--log-dir", str(work / "logs"), "--health-port", "0",
                *worker_args(args, work)]

    return argv


def torchrun_argv(args: argparse.Namespace) -> Callable[[Path], list[str]]:
    def argv(work: Path) -> list[str]:
        return [str(TORCHRUN), "--nproc-per-node", str(args.nproc), "--tee", "3",
                "--log-dir", str(work / "logs"), *worker_args(args, work)]

    return argv


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--lines", type=int, default=200_000)
    p.add_argument("--width", type=int, default=40, help="payload characters per line")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--skip-torchrun", action="store_true")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="log-throughput-"))
    (root / "worker.py").write_text(WORKER)
    modes: dict[str, Callable[[Path], list[subprocess.Popen[bytes]]]] = {
        "direct (files)": launch_direct(args),
        "elastic-supervisor": launch_agent(args, supervisor_argv(args)),
    }
    if not args.skip_torchrun and TORCHRUN.exists():
        modes["torchrun"] = launch_agent(args, torchrun_argv(args))
    results: dict[str, list[Result]] = {name: [] for name in modes}
    for i in range(args.repeat):  # interleave modes so drift affects all of them alike
        for name, launch in modes.items():
            results[name].append(measure(root / f"{i}-{name.split()[0]}", launch))
    report(args, results)
    shutil.rmtree(root)


def report(args: argparse.Namespace, results: dict[str, list[Result]]) -> None:
    def med(name: str, key: Callable[[Result], float]) -> float:
        return statistics.median(key(r) for r in results[name])

    base_wall = med("direct (files)", lambda r: r.wall)
    torch_agent = med("torchrun", lambda r: r.agent_cpu) if "torchrun" in results else None
    expected = args.nproc * args.lines
    print(f"{args.nproc} workers x {args.lines} lines ({args.width}-char payload), --tee 3, "
          f"prefix; median of {args.repeat}; cores: {os.cpu_count()}")
    header = (f"{'mode':<20} {'wall s':>7} {'x base':>7} {'job cpu':>8} {'agent cpu':>9} "
              f"{'x torch':>7} {'broken':>7} {'console':>9} {'files':>9}")
    print(header)
    print("-" * len(header))
    for name in results:
        wall = med(name, lambda r: r.wall)
        agent = med(name, lambda r: r.agent_cpu)
        ratio = f"{agent / torch_agent:.2f}" if torch_agent else "-"
        direct = name.startswith("direct")
        print(f"{name:<20} {wall:>7.2f} {wall / base_wall:>7.2f} "
              f"{med(name, lambda r: r.job_cpu):>8.2f} "
              f"{'-' if direct else f'{agent:.2f}':>9} {'-' if direct else ratio:>7} "
              f"{'-' if direct else int(med(name, lambda r: r.broken)):>7} "
              f"{'-' if direct else int(med(name, lambda r: r.console)):>9} "
              f"{int(med(name, lambda r: r.files)):>9}")
    print(f"expected lines per mode: {expected}")


if __name__ == "__main__":
    main()
