"""Shared machinery of the side-by-side benchmarks: launchers, one job, statistics.

A ``Launcher`` turns a scenario (workers, restarts, log dir, worker arguments) into the
command line of elastic-supervisor or torchrun with the same meaning. A ``Job`` runs one
launcher in a private temporary directory and always cleans up: the launcher gets SIGTERM,
then SIGKILL, and every process it ever started (seen through psutil or through the
workers' own records) is killed if it is still alive. Nothing here is used by the tests.

Every script under benchmarks/ takes its paths, ports and progress log from here. Run them
inside the venv (``pip install -e .`` puts the repository root on ``sys.path``), as
``python -m benchmarks.NAME`` or ``python benchmarks/NAME.py``.
"""

from __future__ import annotations

import compileall
import contextlib
import functools
import os
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKER = HERE / "bench_worker.py"
BIN = Path(sys.executable).parent  # the venv's bin: its python, elastic-supervisor, torchrun

STOP_GRACE = 20.0  # seconds between SIGTERM and SIGKILL of a launcher during clean-up


def log(text: str) -> None:
    """Progress, to stderr (stdout carries the results), stamped with the wall clock."""
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def free_port() -> int:
    """A port the kernel just gave out on 127.0.0.1, for a server told its port up front."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def stop_session(proc: subprocess.Popen[bytes], grace: float = 30) -> None:
    """SIGTERM ``proc``'s session (it was started with ``start_new_session``), wait up to
    ``grace`` seconds, then SIGKILL whatever is left in it (torchrun's workers too)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class BenchError(RuntimeError):
    """A benchmark run did not do what it should (timeout, bad exit, missing record)."""


# ------------------------------------------------------------------ launchers


@dataclass(frozen=True)
class Launcher:
    """One way of running the scenario: our supervisor or torchrun with some flags."""

    name: str
    kind: str  # "ours" or "torchrun"
    extra: tuple[str, ...] = ()

    def command(self) -> list[str]:
        if self.kind == "ours":
            ensure_bytecode()
            exe = BIN / "elastic-supervisor"
            if exe.exists():
                return [str(exe), "run"]
            return [sys.executable, "-m", "supervisor", "run"]
        exe = BIN / "torchrun"
        return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]

    def argv(
        self, *, nproc: int, max_restarts: int, log_dir: Path, args: Sequence[str]
    ) -> list[str]:
        # Single node, the embedded rendezvous, no --master-port: what a user types.
        # (torchrun 2.13 turns --standalone into c10d on localhost:0, and so does
        # "--rdzv-backend static --nnodes 1" when --master-port is left out.)
        common = [
            "--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--max-restarts", str(max_restarts), "--log-dir", str(log_dir),
        ]
        own = ["--health-port", "0"] if self.kind == "ours" else []
        return [*self.command(), *common, *own, *self.extra, str(WORKER), *args]


@functools.cache
def ensure_bytecode() -> None:
    """Compile our package's bytecode, as ``pip install`` does for a regular install.

    torch, like every regularly installed package, has its ``.pyc`` files. An editable
    install has none until Python writes them, and environments that set
    ``PYTHONDONTWRITEBYTECODE`` (this one does) never do: every start would compile our
    modules from source (~30 ms here), which no installed supervisor pays."""
    import supervisor

    compileall.compile_dir(Path(supervisor.__file__).parent, quiet=1)


OURS = Launcher("elastic-supervisor", "ours")
TORCHRUN = Launcher("torchrun", "torchrun")
TORCHRUN_FAST = Launcher(
    "torchrun --monitor-interval 0.01", "torchrun", ("--monitor-interval", "0.01")
)


def launcher_env() -> dict[str, str]:
    """The environment both launchers get: ours, minus anything that would change them."""
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith(("PET_", "TORCHELASTIC_", "SUPERVISOR_"))
        and k not in ("LOGLEVEL", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["OMP_NUM_THREADS"] = "1"  # torchrun sets 1 (with a warning) when unset; say it for both
    return env


# ------------------------------------------------------------------ one job


@dataclass
class Job:
    """One launcher run in a private temp dir. Use as a context manager."""

    launcher: Launcher
    mode: str  # bench_worker mode: exit, idle or crash
    nproc: int
    max_restarts: int = 0
    crashes: int = 0
    keep: bool = field(default_factory=lambda: bool(os.environ.get("BENCH_KEEP")))
    root: Path = field(init=False)
    out: Path = field(init=False)
    proc: subprocess.Popen[bytes] | None = field(init=False, default=None)
    pidfd: int = field(init=False, default=-1)
    t_spawn: float = field(init=False, default=0.0)  # monotonic, just before Popen
    t_exit: float | None = field(init=False, default=None)
    _seen: dict[int, psutil.Process] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix=f"bench-{self.launcher.kind}-"))
        self.out = self.root / "out"
        self.out.mkdir()

    # -- lifecycle
    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        args = [self.mode, str(self.out)] + ([str(self.crashes)] if self.mode == "crash" else [])
        argv = self.launcher.argv(
            nproc=self.nproc, max_restarts=self.max_restarts, log_dir=self.root / "logs", args=args
        )
        (self.root / "argv").write_text(" ".join(argv) + "\n")
        with (
            open(self.root / "launcher.out", "wb") as out,
            open(self.root / "launcher.err", "wb") as err,
        ):
            self.t_spawn = time.monotonic()
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=launcher_env(),
                cwd=self.root, start_new_session=True, close_fds=True,
            )
        self.pidfd = os.pidfd_open(self.proc.pid)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def wait(self, timeout: float) -> int:
        """Wait for the launcher to exit; record the exit time precisely (pidfd)."""
        assert self.proc is not None
        if self.proc.returncode is None:
            poller = select.poll()
            poller.register(self.pidfd, select.POLLIN)
            if not poller.poll(max(0.0, timeout) * 1000):
                raise BenchError(f"{self.launcher.name}: still running after {timeout:.0f} s")
            self.t_exit = time.monotonic()
            self.proc.wait()
        return self.proc.returncode

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def close(self) -> None:
        """Stop the launcher and everything it started; remove the temp dir."""
        if self.proc is not None:
            self._remember(self._descendants())
            if self.running():
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(STOP_GRACE)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
            self._remember(self._worker_processes())
            for p in self._seen.values():
                with contextlib.suppress(psutil.Error):
                    p.kill()
            psutil.wait_procs(list(self._seen.values()), timeout=10)
            if self.pidfd >= 0:
                os.close(self.pidfd)
                self.pidfd = -1
        if not self.keep:
            shutil.rmtree(self.root, ignore_errors=True)

    # -- what the workers recorded
    def up_times(self, restart: int) -> list[float]:
        return [float(t) for t, _ in self._records(restart)]

    def worker_pids(self, restart: int) -> list[int]:
        return [int(p) for _, p in self._records(restart)]

    def _records(self, restart: int) -> list[tuple[str, str]]:
        found = []
        for path in self.out.glob(f"up_{restart}_*"):
            if ".tmp" in path.name:
                continue
            t, pid = path.read_text().split()
            found.append((t, pid))
        return found

    def crash_time(self, restart: int) -> float:
        return float((self.out / f"crash_{restart}").read_text())

    def wait_up(self, restart: int, count: int, timeout: float, poll: float = 0.01) -> None:
        """Wait until ``count`` workers of attempt ``restart`` have recorded their first line."""
        deadline = time.monotonic() + timeout
        while len(self._records(restart)) < count:
            if not self.running():
                raise BenchError(f"{self.launcher.name} exited early: {self.tail()}")
            if time.monotonic() > deadline:
                raise BenchError(f"{self.launcher.name}: workers not up after {timeout:.0f} s")
            time.sleep(poll)

    def tail(self, lines: int = 5) -> str:
        text = (self.root / "launcher.err").read_text(errors="replace").splitlines()
        return " | ".join(text[-lines:])

    # -- the launcher's own processes
    def helpers(self, restart: int = 0) -> list[psutil.Process]:
        """The launcher's descendants that are not workers (our guardian; torchrun: none)."""
        workers = set(self.worker_pids(restart))
        return [p for p in self._descendants() if p.pid not in workers]

    def _descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return []

    def _worker_processes(self) -> list[psutil.Process]:
        procs = []
        for restart in range(self.max_restarts + 1):
            for pid in self.worker_pids(restart):
                with contextlib.suppress(psutil.Error):
                    procs.append(psutil.Process(pid))
        return procs

    def _remember(self, procs: list[psutil.Process]) -> None:
        for p in procs:
            self._seen.setdefault(p.pid, p)


# ------------------------------------------------------------------ measurements


def cpu_seconds(procs: Sequence[psutil.Process]) -> float:
    """User + system CPU of the processes (psutil, clock-tick resolution)."""
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def sched_seconds(procs: Sequence[psutil.Process]) -> float:
    """CPU time of the processes in ns resolution, every thread (dead ones too).

    Reads each process's CPU-time clock (``clock_gettime`` on the clock id that
    ``clock_getcpuclockid(pid)`` would return: ``~pid << 3 | CPUCLOCK_SCHED``); falls back
    to the live threads' ``/proc/PID/task/*/schedstat``.
    """
    total = 0.0
    for p in procs:
        try:
            total += time.clock_gettime(((~p.pid) << 3) | 2)
            continue
        except OSError:
            pass
        for task in Path(f"/proc/{p.pid}/task").glob("*"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int((task / "schedstat").read_text().split()[0]) / 1e9
    return total


def rss_bytes(procs: Sequence[psutil.Process]) -> int:
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def uss_bytes(procs: Sequence[psutil.Process]) -> int:
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_full_info().uss
    return total


# ------------------------------------------------------------------ statistics


@dataclass(frozen=True)
class Summary:
    n: int
    median: float
    low: float
    high: float
    p90: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        if not values:
            raise BenchError("no samples")
        ordered = sorted(values)
        p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
        return cls(len(ordered), statistics.median(ordered), ordered[0], ordered[-1], p90)


def alternate(items: Sequence[Launcher], rep: int) -> list[Launcher]:
    """Every other repetition runs the launchers in reverse order (cache, noise drift)."""
    return list(items) if rep % 2 == 0 else list(reversed(items))


@contextlib.contextmanager
def job(launcher: Launcher, **kw: object) -> Iterator[Job]:
    j = Job(launcher, **kw)  # type: ignore[arg-type]
    try:
        yield j
    finally:
        j.close()
