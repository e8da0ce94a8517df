"""Chaos run: random faults against a real supervisor for a bounded time, then invariants.

    python benchmarks/chaos.py [--seconds 60] [--seed N] [--workers 4] [--json FILE] [--keep]

One real daemon (``python -m supervisor run``) supervises WORKERS chaos workers with a
huge ``--max-restarts``, ``--health-port 0``, the deadline FIFO and ``--tee 3`` (output
through the supervisor's pipes). Every worker keeps a grandchild (``sleep``; odd ranks put
it in a session of its own, as a daemonising library would) and renews a ``loop`` deadline
every 0.2 s. For SECONDS the harness injects, at random:

- destructive faults, one at a time (each is waited out: the next group must come up):
  ``crash`` (a random non-zero exit code), ``sigkill`` (SIGKILL a worker), ``hang`` (a
  worker blocks inside ``supervisor.worker.expires(0.3)``), ``sigstop`` (SIGSTOP a worker:
  its ``loop`` deadline expires), ``sigstop+crash`` (SIGSTOP one worker, crash another: the
  group stop must SIGKILL a stopped process), ``guardian-stop`` (SIGSTOP the guardian and
  fill its pipe, then crash a worker: the restart must not block on the pipe);
- ``flood`` (a worker writes thousands of lines at once), ``grandchild`` (SIGKILL a
  worker's grandchild), ``sigusr1`` (to the supervisor: forwarded to every worker);
- ``frozen`` (the supervisor itself is SIGSTOPped for longer than the workers' ``loop``
  deadline, then SIGCONTed: no worker may be killed as hung, the same group answers a
  forwarded SIGUSR1 afterwards);
- ``diskfull`` (only with ``--disk-full``, as root: the log directory is a tmpfs; it is
  filled while a worker floods, then freed: the rank's ``stdout.log`` must carry the
  supervisor's "bytes of output lost" marker followed by what the worker wrote after);
- ``etcd-quorum`` (only with ``--etcd``: the supervisor runs the etcd backend against a
  3-member cluster the harness starts; two members are SIGSTOPped, so no quorum, for
  longer than the lease TTL, then continued: the healthy group must ride the outage out,
  with no worker exit, no restart and no re-formed group, and answer a forwarded SIGUSR1
  afterwards). ``frozen`` is left out with ``--etcd``: a supervisor frozen past its lease
  TTL is a node that left, and the job rightly re-forms;
- in the background, all the time: ``fifo`` (garbage, oversized lines and forged requests
  naming foreign processes, the supervisor, its guardian and pid 1 written to the deadline
  FIFO), ``http`` (probe storms: every path and method, unknown paths, raw garbage) and
  ``sighup`` (the event log is renamed first, as logrotate does).

Foreign processes (started by the harness, not under the supervisor) log every signal
they get. At the end the harness checks, and counts a violation for each failure:

- the supervisor is alive, answers ``/healthz``, and the group is running again;
- every fault is accounted for: the victim's ``worker_exited`` event (exit code or
  signal) and the root cause in ``events.jsonl``; restarts and failures by kind, FIFO
  rejections by reason, HTTP requests by path and code, forwarded signals and log
  reopens in ``/metrics`` and the event log;
- restarts never exceed the budget (``/status`` agrees with the event log);
- no zombie child of the supervisor; after SIGTERM, no process carrying this run's
  marker (``CHAOS_RUN=<token>`` in its environment, inherited by every worker and
  descendant) is left;
- foreign processes alive, never stopped, never signalled;
- the supervisor's fds and threads back to within a small bound of the start, and RSS too;
- after a ``frozen`` fault, no ``deadline_expired`` for the frozen group's ``loop`` scope
  and a logged stall; after a ``diskfull`` fault, the lost-output marker in the rank's log;
- every attempt's log directory exists with every rank's files.

HTTP latencies of requests in flight during a freeze are left out of the figures.
Prints a table (faults by kind: injected, survived, violations) and exits 1 on any
violation. Progress goes to stderr. Nothing here is used by the library.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import anyio.to_thread
import psutil
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from supervisor.core.deadlines import PIPE_BUF, Rejected, parse_request  # noqa: E402

MARK = "CHAOS_RUN"  # in the supervisor's environment: every worker and descendant has it
FOREIGN_MARK = "CHAOS_FOREIGN"  # processes the supervisor must never touch
SHUTDOWN_TIMEOUT = 2.0  # the supervisor's grace before SIGKILL (a SIGSTOPped worker needs it)
LOOP_DEADLINE = 4.0  # every worker renews a deadline this long every 0.2 s
FREEZE = LOOP_DEADLINE + 1.0  # the ``frozen`` fault stops the supervisor this long
ETCD_TTL = 2  # lease TTL of the supervisor under ``--etcd``
ETCD_OUTAGE = 2 * ETCD_TTL + 1.0  # the ``etcd-quorum`` fault lasts this long
# No ``frozen`` fault under ``--etcd``: a supervisor stopped for FREEZE s (> ETCD_TTL) is, by
# design, a node that left the job (its lease expires while etcd is reachable, and the job
# re-forms: here, with it again), not a fault to ride out. FREEZE must exceed the workers'
# deadline, and a TTL above it would make each quorum-loss fault last 2 * TTL.
LOG_TMPFS_SIZE = "256m"  # the log directory's tmpfs with --disk-full
LOST_MARKER = b"bytes of output lost here: "
HANG_DEADLINE = 0.3
DESTRUCTIVE = ("crash", "sigkill", "hang", "sigstop", "sigstop+crash", "guardian-stop")
WAIT = 40.0  # longest wait for any one consequence (a restart, a reply)
FD_BOUND = 2  # "back within a small bound of the start"
THREAD_BOUND = 2
RSS_BOUND_MB = 10.0

WORKER = r'''
import os, signal, socket, subprocess, sys, time

CTL = os.environ["CHAOS_CTL"]
CMD = os.environ["CHAOS_CMD"]
rank = int(os.environ["LOCAL_RANK"])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
pending = []
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
sock.settimeout(5)


def send(text):
    try:
        sock.sendto(text.encode(), CTL)
    except OSError:
        pass


def on_usr1(_n, _f):
    send(f"usr1 {restart} {rank} {os.getpid()}")


def on_usr2(_n, _f):
    with open(os.path.join(CMD, f"cmd.{os.getpid()}")) as f:
        cmd = f.read().split()
    if cmd[0] == "exit":
        os._exit(int(cmd[1]))
    if cmd[0] == "hang":
        from supervisor.worker import expires
        with expires(after=float(cmd[1]), scope="chaos-hang"):
            while True:
                time.sleep(3600)
    pending.append(cmd)


# before anything else: a forwarded SIGUSR1 must never kill a worker that is up
signal.signal(signal.SIGUSR1, on_usr1)
signal.signal(signal.SIGUSR2, on_usr2)
# exits at once on SIGTERM, like a training script that saves nothing; while SIGSTOPped the
# handled SIGTERM stays pending, so the group stop has to escalate to SIGKILL
signal.signal(signal.SIGTERM, lambda _n, _f: os._exit(143))
from supervisor.worker import expires  # noqa: E402


def grandchild():
    # ignores the SIGUSR1/SIGUSR2 the supervisor forwards to the worker's process group,
    # so only the harness kills it (ignored dispositions survive exec)
    return subprocess.Popen(["sh", "-c", "trap '' USR1 USR2; exec sleep 3600"],
                            start_new_session=bool(rank % 2))


gc = grandchild()
send(f"ready {restart} {rank} {os.getpid()} {gc.pid} {os.environ['TORCHELASTIC_TIMER_FILE']}")
while True:
    with expires(after=float(sys.argv[1]), scope="loop"):
        time.sleep(0.2)
    if gc.poll() is not None:
        gc = grandchild()
        send(f"gc {restart} {rank} {os.getpid()} {gc.pid}")
    while pending:
        cmd = pending.pop(0)
        if cmd[0] == "flood":
            tag, count = cmd[1], int(cmd[2])
            pad = "x" * 60
            for i in range(count):
                os.write(1, f"flood {tag} {i} {pad}\n".encode())
            send(f"flooded {tag} {os.getpid()}")
'''

FOREIGN = r'''
import os, signal, sys, time
log = sys.argv[1]
def note(n, _f):
    with open(log, "a") as f:
        f.write(f"{n}\n")
for s in signal.Signals:
    if s not in (signal.SIGKILL, signal.SIGSTOP):
        try:
            signal.signal(s, note)
        except (OSError, ValueError):
            pass
print("up", flush=True)
while True:
    time.sleep(3600)
'''


def fill_disk(path: Path) -> None:
    """Write zeros to ``path`` until its file system is full."""
    block = b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while f.write(block):
                pass
        with contextlib.suppress(OSError):
            while f.write(b"\0" * 4096):
                pass


def log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- records


@dataclass
class Fault:
    """One injected fault and what it must lead to."""

    kind: str
    at: float
    victim: int | None = None  # pid
    detail: dict[str, Any] = field(default_factory=dict)
    observed: bool = False  # its consequence was seen during the run
    problems: list[str] = field(default_factory=list)


@dataclass
class Usage:
    fds: int
    threads: int
    rss_mb: float
    children: int

    @classmethod
    def of(cls, pid: int, workers: set[int]) -> Usage:
        """``workers``: the current group's pids (a warm worker keeps its standby's
        command line)."""
        proc = psutil.Process(pid)
        return cls(
            fds=len(os.listdir(f"/proc/{pid}/fd")),
            threads=len(os.listdir(f"/proc/{pid}/task")),
            rss_mb=proc.memory_info().rss / 1e6,
            # standbys come and go with attempts (one per rank while a restart is possible)
            children=len([c for c in proc.children()
                          if c.pid in workers or not is_standby(c)]),
        )


def is_standby(proc: psutil.Process) -> bool:
    """A pre-started interpreter waiting for the next attempt's worker (warm restarts)."""
    from supervisor.workers.warm.standby import is_standby_command

    try:
        return is_standby_command(proc.cmdline())
    except psutil.Error:
        return False


@dataclass
class Report:
    seed: int
    seconds: float
    workers: int
    faults: dict[str, dict[str, int]]
    violations: list[str]
    restarts: int
    attempts: int
    usage_start: dict[str, Any]
    usage_end: dict[str, Any]
    http_requests: int
    http_max_latency_ms: float
    http_p99_latency_ms: float
    fifo_lines: int
    orphans: int
    foreign_signalled: int
    wall: float


# ---------------------------------------------------------------------------- the board


class Board:
    """What the harness has seen: worker messages and the supervisor's events."""

    def __init__(self) -> None:
        self.ready: dict[int, dict[int, tuple[int, int]]] = {}  # restart -> rank -> (pid, gc)
        self.gc: dict[int, int] = {}  # worker pid -> its current grandchild
        self.usr1: Counter[tuple[int, int]] = Counter()  # (restart, rank) -> count
        self.flooded: set[str] = set()
        self.events: list[dict[str, Any]] = []
        self.fifo: str | None = None
        self.messages = 0
        self._changed = anyio.Event()

    def changed(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for(self, what: str, pred: Callable[[], bool], timeout: float = WAIT) -> None:
        try:
            with anyio.fail_after(timeout):
                while not pred():
                    await self._changed.wait()
        except TimeoutError:
            raise TimeoutError(f"no {what} within {timeout:g} s") from None

    def feed(self, text: str) -> None:
        parts = text.split()
        self.messages += 1
        if parts[0] == "ready":
            restart, rank, pid, gc = map(int, parts[1:5])
            self.ready.setdefault(restart, {})[rank] = (pid, gc)
            self.gc[pid] = gc
            self.fifo = parts[5]
        elif parts[0] == "gc":
            self.gc[int(parts[3])] = int(parts[4])
        elif parts[0] == "usr1":
            self.usr1[(int(parts[1]), int(parts[2]))] += 1
        elif parts[0] == "flooded":
            self.flooded.add(parts[1])
        self.changed()

    def event(self, event: dict[str, Any]) -> None:
        """One of the supervisor's events. A group started without a failure restart (a
        membership round keeps TORCHELASTIC_RESTART_COUNT) replaces the workers known
        under that restart count: forget those whose rank now has another pid."""
        self.events.append(event)
        if event["event"] == "group_started":
            known = self.ready.get(int(event["restart_count"]), {})
            for rank, pid in event.get("pids", {}).items():  # JSON: the ranks are strings
                if int(rank) in known and known[int(rank)][0] != pid:
                    del known[int(rank)]

    def groups_started(self) -> int:
        return len(self.events_named("group_started"))

    def events_named(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == name]

    @property
    def restart(self) -> int:
        """The restart count of the newest group the workers reported from."""
        return max(self.ready, default=-1)


class EventTail:
    """Follows ``events.jsonl`` across renames (logrotate + SIGHUP), feeding the board."""

    def __init__(self, path: Path, board: Board) -> None:
        self.path = path
        self.board = board
        self._file: Any = None
        self._buf = b""

    def _open(self) -> bool:
        try:
            self._file = open(self.path, "rb")  # noqa: SIM115 - held across polls
        except FileNotFoundError:
            return False
        return True

    def poll(self) -> None:
        if self._file is None and not self._open():
            return
        self._drain()
        try:
            renamed = os.stat(self.path).st_ino != os.fstat(self._file.fileno()).st_ino
        except FileNotFoundError:
            renamed = False  # renamed, new one not made yet: keep reading the old one
        if renamed:  # the new file exists, so the supervisor is done with the old one
            self._drain()
            self._file.close()
            self._file = None
            self._buf = b""
            if self._open():
                self._drain()

    def _drain(self) -> None:
        data = self._file.read()
        if not data:
            return
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            if line.strip():
                self.board.event(json.loads(line))
        self.board.changed()

    async def run(self) -> None:
        while True:
            self.poll()
            await anyio.sleep(0.02)  # pacing: a file has no readiness to wait on

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


# ---------------------------------------------------------------------------- helpers


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaves(inner)]
    return [exc]


def has_mark(pid: int, mark: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return mark in f.read().split(b"\0")
    except OSError:
        return False


def marked_processes(mark: bytes) -> list[int]:
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me and has_mark(int(entry), mark):
            found.append(int(entry))
    return found


def proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def metric(samples: dict[Any, float], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for (sample_name, sample_labels), value in samples.items():
        if sample_name == name and set(labels.items()) <= set(sample_labels):
            total += value
    return total


def fifo_lines(rng: random.Random, targets: dict[str, int]) -> list[tuple[bytes, str]]:
    """Garbage and forged deadline requests, each with the rejection reason it must get."""
    now = time.time()
    out: list[tuple[bytes, str]] = []

    def forged(target: int, **over: Any) -> bytes:
        obj = {"version": 1, "pid": target, "scope_id": f"chaos{rng.randrange(10**6)}",
               "expiration_time": now - rng.random() * 10, "signal": int(signal.SIGKILL)}
        obj.update(over)
        return json.dumps(obj).encode()

    for _ in range(rng.randint(3, 12)):
        roll = rng.random()
        if roll < 0.2:
            line = bytes(rng.randrange(256) for _ in range(rng.randint(1, 300)))
        elif roll < 0.35:
            value = rng.choice([[], [1, 2], "x", 3.5, None, True, {"a": 1}, "{" * 50])
            line = json.dumps(value).encode()
        elif roll < 0.5:
            field_name = rng.choice(["version", "pid", "scope_id", "expiration_time", "signal"])
            line = forged(targets["foreign"], **{field_name: rng.choice(["1", None, [1], True])})
        elif roll < 0.6:
            bad: list[dict[str, Any]] = [
                {"version": 2}, {"pid": -5}, {"pid": 0}, {"pid": 2**40}, {"signal": 99},
                {"signal": 0}, {"expiration_time": 1e400},
            ]
            line = forged(targets["foreign"], **rng.choice(bad))
        elif roll < 0.68:
            line = forged(targets["foreign"], scope_id="y" * rng.randint(PIPE_BUF, 3 * PIPE_BUF))
        elif roll < 0.68 + 0.2:
            line = forged(targets[rng.choice(["foreign", "foreign2", "guardian", "init"])])
        else:
            line = forged(targets["supervisor"])
        line = line.replace(b"\n", b" ").replace(b"\r", b" ") or b"?"
        if not line.strip(b" "):
            line = b"?"
        out.append((line, expected_reason(line, targets)))
    return out


def expected_reason(line: bytes, targets: dict[str, int]) -> str:
    if len(line) > PIPE_BUF:
        return "oversized"
    result = parse_request(line)
    if isinstance(result, Rejected):
        return result.reason.value
    if result.pid == targets["supervisor"]:
        return "supervisor_pid"
    return "not_owned"  # foreign processes, the guardian and pid 1 are alive, never ours


# ---------------------------------------------------------------------------- the run


class Chaos:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.root = Path(tempfile.mkdtemp(prefix="chaos-"))
        self.token = f"{os.getpid()}-{self.rng.randrange(10**9)}"
        self.mark = f"{MARK}={self.token}".encode()
        self.board = Board()
        self.faults: list[Fault] = []
        self.violations: list[str] = []
        self.proc: anyio.abc.Process | None = None
        self.port = 0
        self.guardian = 0
        self.foreign: dict[int, Path] = {}
        self.foreign_procs: list[Any] = []
        self.http_sent: Counter[tuple[str, int]] = Counter()
        self.http_latency: list[float] = []
        self.fifo_expected: Counter[str] = Counter()
        self.n_sigusr1 = 0
        self.n_sighup = 0
        self.usage_start: Usage | None = None
        self.usage_end: Usage | None = None
        self.orphans: list[int] = []
        self.stop_injecting = anyio.Event()
        self.floods = 0
        self.tail = EventTail(self.root / "logs" / "chaos" / "events.jsonl", self.board)
        self.log_tmpfs: Path | None = None
        self.etcd: Any = None  # tests.etcd_server.EtcdFactory with --etcd
        self.freeze_epoch = 0  # counts SIGSTOPs and SIGCONTs of the supervisor
        self.fifo_quiet = anyio.Lock()  # held by a FIFO fault, or by a freeze

    # -- set-up ------------------------------------------------------------------
    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def violate(self, text: str) -> None:
        log("VIOLATION: " + text)
        self.violations.append(text)

    def mount_log_tmpfs(self) -> None:
        """``--disk-full``: the log directory becomes a tmpfs the harness can fill."""
        logs = self.root / "logs"
        logs.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={LOG_TMPFS_SIZE}", "tmpfs",
                               str(logs)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            log(f"--disk-full: cannot mount a tmpfs ({done.stderr.strip()}); fault disabled")
            return
        self.log_tmpfs = logs

    def unmount_log_tmpfs(self) -> None:
        if self.log_tmpfs is not None:
            subprocess.run(["umount", "-l", str(self.log_tmpfs)], capture_output=True,
                           check=False)
            self.log_tmpfs = None

    async def start(self) -> None:
        if self.args.disk_full:
            self.mount_log_tmpfs()
        (self.root / "worker.py").write_text(WORKER)
        (self.root / "cmd").mkdir()
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PET_", "TORCHELASTIC_"))
               and k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
        env.update({MARK: self.token, "CHAOS_CTL": str(self.root / "ctl.sock"),
                    "CHAOS_CMD": str(self.root / "cmd"), "PYTHONPATH": str(REPO),
                    "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
        rdzv: list[str] = []
        if self.args.etcd:
            from tests.etcd_server import EtcdFactory

            (self.root / "etcd").mkdir()
            self.etcd = EtcdFactory(self.root / "etcd")
            members = self.etcd.cluster(3)
            rdzv = ["--rdzv-backend", "etcd", "--nnodes", "1",
                    "--rdzv-endpoint", ",".join(m.endpoint for m in members),
                    "--rdzv-conf", f"lease_ttl={ETCD_TTL},last_call_timeout=0.2"]
        argv = [
            sys.executable, "-m", "supervisor", "run", *rdzv,
            "--nproc-per-node", str(self.args.workers),
            "--max-restarts", str(self.args.max_restarts), "--health-port", "0",
            "--health-host", "127.0.0.1", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT),
            "--tee", "3", "--log-dir", str(self.root / "logs"), "--rdzv-id", "chaos",
            "--progress-timeout", "60", "--hang-state-timeout", "2",  # D-state check: 0.5 s
            str(self.root / "worker.py"), str(LOOP_DEADLINE),
        ]
        with open(self.root / "console.out", "wb") as out, \
                open(self.root / "supervisor.err", "wb") as err:
            self.proc = await anyio.open_process(argv, stdout=out, stderr=err, env=env,
                                                 cwd=self.root, start_new_session=True)
        log(f"supervisor pid {self.pid}, run dir {self.root}")

    async def start_foreign(self) -> None:
        env = {**os.environ, FOREIGN_MARK: self.token}
        env.pop(MARK, None)
        for i in range(2):
            sigs = self.root / f"foreign{i}.signals"
            sigs.touch()
            proc = await anyio.open_process(
                [sys.executable, "-c", FOREIGN, str(sigs)], env=env, start_new_session=bool(i),
                stderr=None,
            )
            assert proc.stdout is not None
            with anyio.fail_after(20):
                await proc.stdout.receive()  # "up": its handlers are installed
            self.foreign[proc.pid] = sigs
            self.foreign_procs.append(proc)

    async def control(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        path = self.root / "ctl.sock"
        sock = await anyio.create_unix_datagram_socket(local_path=path)
        async with sock:
            task_status.started()
            while True:
                data, _ = await sock.receive()
                self.board.feed(data.decode())

    async def wait_health(self) -> None:
        def listening() -> bool:
            return bool(self.board.events_named("health_listening"))

        await self.board.wait_for("health endpoint", listening)
        self.port = int(self.board.events_named("health_listening")[0]["port"])

    def find_guardian(self) -> int:
        """The supervisor's one child that is neither a worker nor a standby interpreter
        (call while the group is up)."""
        workers = {pid for group in self.board.ready.values() for pid, _ in group.values()}
        others = [c.pid for c in psutil.Process(self.pid).children()
                  if c.pid not in workers and not is_standby(c)]
        if len(others) != 1:
            raise RuntimeError(f"expected one guardian process, found {others}")
        return others[0]

    # -- waiting on the group ----------------------------------------------------
    def group_up(self, restart: int) -> bool:
        """Every worker of the attempt with that restart count reported ready."""
        workers: int = self.args.workers
        return len(self.board.ready.get(restart, {})) == workers

    async def wait_group(self, restart: int) -> None:
        await self.board.wait_for(f"group {restart} up", lambda: self.group_up(restart))

    def worker_pids(self) -> set[int]:
        return {pid for pid, _ in self.board.ready.get(self.board.restart, {}).values()}

    def current(self) -> tuple[int, dict[int, tuple[int, int]]]:
        r = self.board.restart
        return r, self.board.ready[r]

    # -- faults ------------------------------------------------------------------
    def command(self, pid: int, text: str) -> None:
        if not has_mark(pid, self.mark):
            raise RuntimeError(f"refusing to signal pid {pid}: not this run's")
        tmp = self.root / "cmd" / f"tmp.{pid}"
        tmp.write_text(text)
        os.replace(tmp, self.root / "cmd" / f"cmd.{pid}")
        os.kill(pid, signal.SIGUSR2)

    def kill(self, pid: int, signum: int) -> None:
        if not has_mark(pid, self.mark):
            raise RuntimeError(f"refusing to signal pid {pid}: not this run's")
        fd = os.pidfd_open(pid)
        try:
            signal.pidfd_send_signal(fd, signum)
        finally:
            os.close(fd)

    async def destructive(self, kind: str) -> None:
        restart, group = self.current()
        ranks = sorted(group)
        victim_rank = self.rng.choice(ranks)
        pid = group[victim_rank][0]
        fault = Fault(kind, time.monotonic(), pid, {"restart": restart, "rank": victim_rank})
        self.faults.append(fault)
        if kind == "crash":
            code = self.rng.randint(1, 255)
            fault.detail["exit_code"] = code
            self.command(pid, f"exit {code}")
        elif kind == "sigkill":
            self.kill(pid, signal.SIGKILL)
        elif kind == "hang":
            self.command(pid, f"hang {HANG_DEADLINE}")
        elif kind == "sigstop":
            self.kill(pid, signal.SIGSTOP)
        elif kind == "sigstop+crash":
            other_rank = self.rng.choice([r for r in ranks if r != victim_rank])
            other = group[other_rank][0]
            code = self.rng.randint(1, 255)
            fault.detail.update(other=other, exit_code=code)
            self.kill(pid, signal.SIGSTOP)
            self.command(other, f"exit {code}")
        elif kind == "guardian-stop":
            code = self.rng.randint(1, 255)
            fault.detail["exit_code"] = code
            await self.stop_guardian()
            self.command(pid, f"exit {code}")
        try:
            await self.wait_group(restart + 1)
        finally:
            if kind == "guardian-stop":
                self.kill(self.guardian, signal.SIGCONT)
        fault.observed = True

    async def stop_guardian(self) -> None:
        """SIGSTOP the guardian and fill its pipe (through /proc) with lines it ignores."""
        self.kill(self.guardian, signal.SIGSTOP)
        with anyio.fail_after(WAIT):  # kill() returns before the stop takes effect
            while proc_state(self.guardian) != "T":
                await anyio.sleep(0.01)  # no event tells us
        fd = os.open(f"/proc/{self.guardian}/fd/0", os.O_WRONLY | os.O_NONBLOCK)
        try:
            for chunk in (b"#\n" * 2048, b"#\n"):
                with contextlib.suppress(BlockingIOError):
                    while True:
                        os.write(fd, chunk)
        finally:
            os.close(fd)

    async def flood(self) -> None:
        restart, group = self.current()
        rank = self.rng.choice(sorted(group))
        pid = group[rank][0]
        self.floods += 1
        tag = f"f{self.floods}"
        count = self.rng.randint(2000, 20000)
        fault = Fault("flood", time.monotonic(), pid,
                      {"restart": restart, "rank": rank, "tag": tag, "lines": count})
        self.faults.append(fault)
        self.command(pid, f"flood {tag} {count}")

        async def prober(session: aiohttp.ClientSession) -> None:
            while True:  # the supervisor must stay responsive while the output pours through
                await self.probe(session, "GET", "/healthz")
                await anyio.sleep(0.05)  # pacing

        async with aiohttp.ClientSession() as session, anyio.create_task_group() as tg:
            tg.start_soon(prober, session)
            await self.board.wait_for(f"end of flood {tag}", lambda: tag in self.board.flooded)
            tg.cancel_scope.cancel()
        fault.observed = True

    async def frozen(self) -> None:
        """SIGSTOP the supervisor past the workers' deadline; SIGCONT; the group lives on."""
        restart, group = self.current()
        fault = Fault("frozen", time.monotonic(), self.pid,
                      {"restart": restart, "pids": sorted(p for p, _ in group.values())})
        self.faults.append(fault)
        assert self.proc is not None
        # no FIFO garbage meanwhile: lines over PIPE_BUF written into a FIFO that fills
        # during the freeze are torn and corrupt the workers' own requests (security.md)
        async with self.fifo_quiet:
            await self.freeze(fault, restart)

    async def freeze(self, fault: Fault, restart: int) -> None:
        assert self.proc is not None
        groups = self.board.groups_started()
        self.freeze_epoch += 1  # odd while frozen
        self.proc.send_signal(signal.SIGSTOP)
        try:
            await anyio.sleep(FREEZE)  # the fault itself lasts this long
        finally:
            self.proc.send_signal(signal.SIGCONT)
            self.freeze_epoch += 1
        try:
            await self.sigusr1()  # every rank of the same group must still answer
        except TimeoutError:
            fault.problems.append(f"the group did not answer SIGUSR1 after a {FREEZE:g} s "
                                  "freeze (killed as hung?)")
            return
        if self.board.restart != restart or self.board.groups_started() != groups:
            fault.problems.append(f"the group restarted after a {FREEZE:g} s freeze")
            return
        fault.detail["confirmed"] = time.monotonic()  # the same clock as the events' "mono"
        fault.observed = True

    async def etcd_quorum(self) -> None:
        """SIGSTOP two of the three etcd members (no quorum) for longer than the lease
        TTL, then SIGCONT them: a healthy group rides the outage out (no restart, no worker
        exit) and answers a forwarded SIGUSR1 once etcd is back."""
        assert self.etcd is not None
        restart, _group = self.current()
        stopped = self.rng.sample(self.etcd.members, 2)
        fault = Fault("etcd-quorum", time.monotonic(), None,
                      {"restart": restart, "members": [m.name for m in stopped]})
        self.faults.append(fault)
        exits = len(self.board.events_named("worker_exited"))
        groups = self.board.groups_started()
        for member in stopped:
            assert member.process is not None
            member.process.send_signal(signal.SIGSTOP)
        try:
            await anyio.sleep(ETCD_OUTAGE)  # the outage itself is the fault: it must last
        finally:
            for member in stopped:
                assert member.process is not None
                member.process.send_signal(signal.SIGCONT)
        # a member set that re-forms identically within one TTL after etcd returns is no
        # change: wait that out, then the same group must still be there and answer
        await anyio.sleep(ETCD_TTL + 1.0)  # the grace of the rendezvous leader
        try:
            await self.sigusr1()
        except TimeoutError:
            fault.problems.append("the group did not answer SIGUSR1 after the etcd outage")
            return
        if self.board.restart != restart or self.board.groups_started() != groups:
            fault.problems.append(f"the group restarted after a {ETCD_OUTAGE:g} s quorum loss")
        if len(self.board.events_named("worker_exited")) != exits:
            fault.problems.append("a worker exited during the etcd outage")
        fault.observed = True

    async def diskfull(self) -> None:
        """Fill the log tmpfs while a worker floods; free it; the gap is marked."""
        assert self.log_tmpfs is not None
        restart, group = self.current()
        rank = self.rng.choice(sorted(group))
        pid = group[rank][0]
        self.floods += 1
        lost_tag, after_tag = f"f{self.floods}", f"f{self.floods}b"
        fault = Fault("diskfull", time.monotonic(), pid,
                      {"restart": restart, "rank": rank, "tag": after_tag})
        self.faults.append(fault)
        [attempt_dir] = [e["dir"] for e in self.board.events_named("group_started")
                         if pid in e["pids"].values()] or [None]
        failing = f"cannot write {attempt_dir}/{rank}/stdout.log"
        resumed = f"writing {attempt_dir}/{rank}/stdout.log again"
        seen, seen_resumed = self.stderr_count(failing), self.stderr_count(resumed)
        filler = self.log_tmpfs / f"filler.{self.floods}"
        fill_disk(filler)
        try:
            self.command(pid, f"flood {lost_tag} 2000")
            await self.board.wait_for(f"end of flood {lost_tag}",
                                      lambda: lost_tag in self.board.flooded)
            await self.wait_stderr(failing, seen + 1)  # this time, this rank's file
        finally:
            filler.unlink()
        self.command(pid, f"flood {after_tag} 10")
        await self.board.wait_for(f"end of flood {after_tag}",
                                  lambda: after_tag in self.board.flooded)
        try:  # the marker is written, and this line logged, when writing works again
            await self.wait_stderr(resumed, seen_resumed + 1)
        except TimeoutError:
            fault.problems.append(f"no '{resumed}' in the supervisor's log")
        if self.board.restart != restart:
            fault.problems.append("the group restarted when the log disk was full")
        fault.observed = True

    def stderr_count(self, text: str) -> int:
        """How many times the supervisor's log (a file here) has said ``text``."""
        return (self.root / "supervisor.err").read_bytes().count(text.encode())

    async def wait_stderr(self, text: str, times: int) -> None:
        """Until the supervisor's log has said ``text`` ``times`` times."""
        with anyio.fail_after(WAIT):
            while self.stderr_count(text) < times:
                await anyio.sleep(0.05)  # pacing: a file announces nothing

    async def grandchild(self) -> None:
        _, group = self.current()
        rank = self.rng.choice(sorted(group))
        pid = group[rank][0]
        gc = self.board.gc[pid]
        fault = Fault("grandchild", time.monotonic(), gc, {"worker": pid, "rank": rank})
        self.faults.append(fault)
        if not has_mark(gc, self.mark):  # nothing but the harness may kill a grandchild
            fault.problems.append(f"grandchild {gc} of worker {pid} was gone already "
                                  f"(state {proc_state(gc)})")
            return
        self.kill(gc, signal.SIGKILL)
        await self.board.wait_for("new grandchild", lambda: self.board.gc[pid] != gc)
        fault.observed = True

    async def sigusr1(self) -> None:
        restart, group = self.current()
        before = {rank: self.board.usr1[(restart, rank)] for rank in group}
        fault = Fault("sigusr1", time.monotonic(), None, {"restart": restart})
        self.faults.append(fault)
        self.n_sigusr1 += 1
        assert self.proc is not None
        self.proc.send_signal(signal.SIGUSR1)

        def all_got_it() -> bool:
            return all(self.board.usr1[(restart, r)] > before[r] for r in group)

        await self.board.wait_for("SIGUSR1 forwarded", all_got_it)
        fault.observed = True

    async def sighup(self) -> None:
        self.n_sighup += 1
        fault = Fault("sighup", time.monotonic(), None, {"n": self.n_sighup})
        self.faults.append(fault)
        events = self.root / "logs" / "chaos" / "events.jsonl"
        with contextlib.suppress(FileNotFoundError):
            os.rename(events, events.with_name(f"events.jsonl.{self.n_sighup}"))
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)
        n = self.n_sighup
        await self.board.wait_for(
            "logs reopened", lambda: len(self.board.events_named("logs_reopened")) >= n
        )
        fault.observed = True

    async def fifo(self) -> None:
        if self.board.fifo is None:
            return
        targets = {"foreign": min(self.foreign), "foreign2": max(self.foreign),
                   "supervisor": self.pid, "guardian": self.guardian, "init": 1}
        lines = fifo_lines(self.rng, targets)
        fault = Fault("fifo", time.monotonic(), None, {"lines": len(lines)})
        self.faults.append(fault)
        async with self.fifo_quiet:
            await self.write_fifo(lines)
        fault.observed = True

    async def write_fifo(self, lines: list[tuple[bytes, str]]) -> None:
        assert self.board.fifo is not None
        fd = os.open(self.board.fifo, os.O_WRONLY | os.O_NONBLOCK)
        try:
            for line, reason in lines:
                data = line + b"\n"
                while data:
                    try:
                        data = data[os.write(fd, data):]
                    except BlockingIOError:
                        await anyio.sleep(0.01)  # pacing: the FIFO is full
                self.fifo_expected[reason] += 1
        finally:
            os.close(fd)

    async def probe(self, session: aiohttp.ClientSession, method: str, path: str) -> int | None:
        label = path.split("?")[0]
        started, epoch = time.monotonic(), self.freeze_epoch
        try:
            async with session.request(method, self.url + path,
                                       timeout=aiohttp.ClientTimeout(total=10)) as resp:
                await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.violate(f"HTTP {method} {path}: {type(exc).__name__}: {exc}")
            return None
        if epoch == self.freeze_epoch and epoch % 2 == 0:  # a freeze is not server latency
            self.http_latency.append(time.monotonic() - started)
        known = label in ("/healthz", "/readyz", "/status", "/metrics", "/openapi.json")
        if method in ("GET", "HEAD"):
            allowed = ({200, 503} if label in ("/healthz", "/readyz") else {200}) if known \
                else {404}
        else:
            allowed = {405} if known else {404, 405}
        if status not in allowed:
            self.violate(f"HTTP {method} {path} answered {status}, expected {sorted(allowed)}")
        self.http_sent[(label if known else "other", status)] += 1
        return status

    async def http_storm(self) -> None:
        n = self.rng.randint(50, 250)
        fault = Fault("http", time.monotonic(), None, {"requests": n})
        self.faults.append(fault)
        paths = ["/healthz", "/readyz", "/status", "/metrics", "/openapi.json"]
        connector = aiohttp.TCPConnector(limit=self.rng.randint(1, 40))
        async with aiohttp.ClientSession(connector=connector) as session, \
                anyio.create_task_group() as tg:
            for _ in range(n):
                roll = self.rng.random()
                if roll < 0.6:
                    method, path = self.rng.choice(["GET", "HEAD"]), self.rng.choice(paths)
                elif roll < 0.7:
                    method, path = "GET", self.rng.choice(paths) + "?x=" + "y" * 300
                elif roll < 0.85:
                    method = self.rng.choice(["GET", "HEAD"])
                    path = "/" + "/".join(
                        "".join(self.rng.choice("abcxyz019-_") for _ in range(5))
                        for _ in range(self.rng.randint(1, 4))
                    )
                else:
                    method = self.rng.choice(["POST", "PUT", "DELETE", "PATCH"])
                    path = self.rng.choice(paths)
                tg.start_soon(self.probe, session, method, path)
        for _ in range(self.rng.randint(0, 5)):
            await self.raw_garbage()
        fault.observed = True

    async def raw_garbage(self) -> None:
        junk = bytes(self.rng.randrange(1, 256) for _ in range(self.rng.randint(1, 200)))
        try:
            with anyio.fail_after(10):
                async with await anyio.connect_tcp("127.0.0.1", self.port) as stream:
                    await stream.send(junk + b"\r\n\r\n")
                    reply = b""
                    with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError,
                                             ConnectionResetError):
                        while b"\r\n" not in reply:
                            reply += await stream.receive()
        except (OSError, TimeoutError) as exc:
            self.violate(f"raw garbage request: {type(exc).__name__}: {exc}")
            return
        if reply.startswith(b"HTTP/1.") and reply[9:10] == b"5":
            self.violate(f"raw garbage request answered {reply[:20]!r}")

    # -- loops -------------------------------------------------------------------
    async def background(self, action: Callable[[], Awaitable[None]], low: float,
                         high: float) -> None:
        while not self.stop_injecting.is_set():
            with anyio.move_on_after(self.rng.uniform(low, high)):
                await self.stop_injecting.wait()  # pacing between injections
            if self.stop_injecting.is_set():
                return
            await action()

    async def main_loop(self, until: float) -> None:
        kinds = {"crash": 3, "sigkill": 2, "hang": 2, "sigstop": 1, "sigstop+crash": 1,
                 "guardian-stop": 1,
                 "flood": 2, "grandchild": 2, "sigusr1": 2, "frozen": 1}
        if self.log_tmpfs is not None:
            kinds["diskfull"] = 1
        if self.etcd is not None:
            kinds["etcd-quorum"] = 1
            del kinds["frozen"]  # see the note at ETCD_OUTAGE
        if self.args.kinds:
            wanted = set(self.args.kinds.split(","))
            kinds = {k: w for k, w in kinds.items() if k in wanted} or kinds
        names, weights = list(kinds), list(kinds.values())
        while time.monotonic() < until:
            restart = self.board.restart
            await self.wait_group(restart)
            kind = self.rng.choices(names, weights)[0]
            log(f"{kind} (restart {restart})")
            if kind in DESTRUCTIVE:
                await self.destructive(kind)
            else:
                await {"flood": self.flood, "grandchild": self.grandchild,
                       "sigusr1": self.sigusr1, "frozen": self.frozen,
                       "diskfull": self.diskfull, "etcd-quorum": self.etcd_quorum}[kind]()
            await anyio.sleep(self.rng.uniform(0.05, 0.4))  # pacing

    async def warm_up(self) -> None:
        """One of everything, so lazily made resources exist before the baseline."""
        await self.destructive("crash")
        await self.http_storm()
        await self.fifo()
        await self.flood()
        await self.sighup()
        await self.sigusr1()
        if self.etcd is None:  # see the note at ETCD_OUTAGE
            await self.frozen()
        if self.log_tmpfs is not None:
            await self.diskfull()
        await self.settle()
        self.usage_start = Usage.of(self.pid, self.worker_pids())
        log(f"baseline: {self.usage_start}")

    async def settle(self) -> None:
        """Group running and /readyz 200; connections closed."""
        await self.wait_group(self.board.restart)
        async with aiohttp.ClientSession() as session:
            with anyio.fail_after(WAIT):
                while await self.probe(session, "GET", "/readyz") != 200:
                    await anyio.sleep(0.1)  # pacing: readiness is computed per probe

    # -- the end -----------------------------------------------------------------
    async def final_checks(self) -> None:
        await self.settle()
        if self.proc is None or self.proc.returncode is not None:
            self.violate("the supervisor is not running at the end")
            return
        async with aiohttp.ClientSession() as session:
            if await self.probe(session, "GET", "/healthz") != 200:
                self.violate("/healthz is not 200 at the end")
            async with session.get(self.url + "/status") as resp:
                status = await resp.json()
        self.tail.poll()
        await self.check_metrics()
        self.check_budget(status)
        self.check_zombies()
        await self.check_usage()

    async def check_metrics(self) -> None:
        """Every counter the faults must have moved, read once the FIFO was consumed."""
        want_rejected = dict(self.fifo_expected)
        samples: dict[Any, float] = {}
        async with aiohttp.ClientSession() as session:
            with anyio.move_on_after(WAIT):
                while True:
                    async with session.get(self.url + "/metrics") as resp:
                        text = await resp.text()
                    samples = metric_samples(text)
                    if all(self._rejected(samples, r) >= n for r, n in want_rejected.items()):
                        break
                    await anyio.sleep(0.05)  # pacing: the tailer reads the FIFO meanwhile
        for reason, n in want_rejected.items():
            got = self._rejected(samples, reason)
            # workers' own requests can be refused while their group stops (not owned any
            # more, or already dead); nothing but the harness sends the other kinds
            ok = got >= n if reason in ("not_owned", "dead_pid") else got == n
            if not ok:
                self.violate(f"FIFO rejections {reason!r}: sent {n}, metrics count {got:g}")
        for (label, code), n in self.http_sent.items():
            got = metric(samples, "elastic_supervisor_http_requests_total", path=label,
                         code=str(code))
            if got < n:
                self.violate(f"HTTP {label} {code}: sent {n}, metrics count {got:g}")
        self.check_restart_metrics(samples)

    @staticmethod
    def _rejected(samples: dict[Any, float], reason: str) -> float:
        return metric(samples, "elastic_supervisor_watchdog_rejected_requests_total",
                      reason=reason)

    def expected_root_kinds(self) -> Counter[str]:
        kinds: Counter[str] = Counter()
        for f in self.faults:
            if f.kind in ("crash", "sigstop+crash", "guardian-stop"):
                kinds["exited"] += 1
            elif f.kind == "sigkill":
                kinds["signaled"] += 1
            elif f.kind in ("hang", "sigstop"):
                kinds["deadline"] += 1
        return kinds

    def check_restart_metrics(self, samples: dict[Any, float]) -> None:
        want = self.expected_root_kinds()
        for kind in ("exited", "signaled", "deadline", "unhealthy"):
            failures = metric(samples, "elastic_supervisor_failures_total", kind=kind)
            restarts = metric(samples, "elastic_supervisor_restarts_total", reason=kind)
            if failures != want[kind] or restarts != want[kind]:
                self.violate(f"{kind} failures: injected {want[kind]}, metrics count "
                             f"{failures:g} failures and {restarts:g} restarts")
        exits = metric(samples, "elastic_supervisor_worker_exits_total")
        if exits != len(self.board.events_named("worker_exited")):
            self.violate(f"worker exits: metrics {exits:g}, events "
                         f"{len(self.board.events_named('worker_exited'))}")

    def check_budget(self, status: dict[str, Any]) -> None:
        scheduled = self.board.events_named("restart_scheduled")
        used = status["restarts"]["used"]
        if used != len(scheduled) or used > status["restarts"]["max"]:
            self.violate(f"restarts: /status says {used} of {status['restarts']['max']}, "
                         f"events say {len(scheduled)}")
        if status["restarts"]["left"] != status["restarts"]["max"] - used:
            self.violate(f"restart budget: {status['restarts']}")
        if any(e.get("budget_left", 0) < 0 for e in scheduled):
            self.violate("a restart was scheduled with a negative budget")
        if used != sum(self.expected_root_kinds().values()):
            self.violate(f"restarts: {used} used, {sum(self.expected_root_kinds().values())} "
                         "destructive faults injected")

    def check_zombies(self) -> None:
        for child in psutil.Process(self.pid).children(recursive=True):
            if proc_state(child.pid) == "Z":
                self.violate(f"zombie pid {child.pid} (parent {child.ppid()}) while running")

    async def check_usage(self) -> None:
        assert self.usage_start is not None
        start = self.usage_start
        with anyio.move_on_after(10):  # the server closes the harness's connections
            while True:
                self.usage_end = Usage.of(self.pid, self.worker_pids())
                if self.usage_end.fds <= start.fds + FD_BOUND:
                    break
                await anyio.sleep(0.1)  # pacing
        end = self.usage_end
        assert end is not None
        log(f"at the end: {end}")
        if end.fds > start.fds + FD_BOUND:
            self.violate(f"fds {start.fds} -> {end.fds}")
        if end.threads > start.threads + THREAD_BOUND:
            self.violate(f"threads {start.threads} -> {end.threads}")
        if end.rss_mb > start.rss_mb + RSS_BOUND_MB:
            self.violate(f"RSS {start.rss_mb:.1f} -> {end.rss_mb:.1f} MB")
        if end.children != start.children:
            self.violate(f"children {start.children} -> {end.children}")

    async def stop_supervisor(self) -> None:
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        with anyio.move_on_after(SHUTDOWN_TIMEOUT + 30):
            code = await self.proc.wait()
            if code != 128 + signal.SIGTERM:
                self.violate(f"supervisor exited {code} after SIGTERM, expected 143")
        if self.proc.returncode is None:
            self.violate("supervisor did not exit after SIGTERM")
            self.proc.kill()
            await self.proc.wait()

    async def check_orphans(self) -> None:
        found: list[int] = []
        with anyio.move_on_after(2):  # the kernel finishes SIGKILLs; nothing should be left
            while found := [p for p in marked_processes(self.mark) if proc_state(p) != "Z"]:
                await anyio.sleep(0.05)  # pacing
        self.orphans = found
        for pid in found:
            cmd = psutil.Process(pid).cmdline() if psutil.pid_exists(pid) else []
            self.violate(f"orphan pid {pid} after the supervisor exited: {' '.join(cmd)}")
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def check_foreign(self) -> int:
        signalled = 0
        for pid, sigs in self.foreign.items():
            state = proc_state(pid)
            got = sigs.read_text().split()
            if state is None or state in ("Z", "X"):
                self.violate(f"foreign pid {pid} died")
            elif state == "T":
                self.violate(f"foreign pid {pid} was stopped")
            if got:
                signalled += 1
                self.violate(f"foreign pid {pid} received signals {got}")
        return signalled

    def check_events(self) -> None:
        exits = {e["pid"]: e for e in self.board.events_named("worker_exited")}
        stopping = self.board.events_named("group_stopping")
        for f in self.faults:
            if f.kind in DESTRUCTIVE:
                self._check_destructive(f, exits, stopping)
            elif f.kind == "flood":
                self._check_flood(f)
            elif f.kind == "diskfull":
                self._check_diskfull(f)
            elif f.kind == "frozen":
                self._check_frozen(f)
            elif f.kind == "grandchild" and psutil.pid_exists(f.victim or 0) \
                    and proc_state(f.victim or 0) not in ("Z", None):
                f.problems.append(f"grandchild {f.victim} still alive")
        if len(self.board.events_named("signal_forwarded")) != self.n_sigusr1:
            self.violate(f"SIGUSR1 sent {self.n_sigusr1} times, "
                         f"{len(self.board.events_named('signal_forwarded'))} forwarded")
        if len(self.board.events_named("logs_reopened")) != self.n_sighup:
            self.violate(f"SIGHUP sent {self.n_sighup} times, "
                         f"{len(self.board.events_named('logs_reopened'))} reopens")
        for f in self.faults:
            for problem in f.problems:
                self.violate(f"{f.kind} at restart {f.detail.get('restart')}: {problem}")
        self.check_attempt_dirs()

    def _check_destructive(self, f: Fault, exits: dict[int, Any], stopping: list[Any]) -> None:
        exited = exits.get(f.victim or 0)
        if exited is None:
            f.problems.append(f"no worker_exited event for pid {f.victim}")
            return
        if f.kind in ("crash", "guardian-stop") and \
                exited.get("exit_code") != f.detail["exit_code"]:
            f.problems.append(f"pid {f.victim} exit {exited} != code {f.detail['exit_code']}")
        # a hung worker may take the group stop's SIGTERM (its handler exits 143) before
        # the watchdog's SIGKILL; a stopped one can only die by SIGKILL
        killed = exited.get("signal") == "SIGKILL" or (
            f.kind == "hang" and exited.get("exit_code") == 143)
        if f.kind in ("sigkill", "hang", "sigstop", "sigstop+crash") and not killed:
            f.problems.append(f"pid {f.victim} did not die by SIGKILL: {exited}")
        if f.kind == "sigstop+crash":
            other = exits.get(f.detail["other"])
            if other is None or other.get("exit_code") != f.detail["exit_code"]:
                f.problems.append(f"crashed pid {f.detail['other']}: {other}")
        root_pid = f.detail.get("other", f.victim)
        word = "deadline" if f.kind in ("hang", "sigstop") else \
            "killed by SIGKILL" if f.kind == "sigkill" else "exited with code"
        if not any(f"(pid {root_pid})" in str(e.get("root_cause")) and word in
                   str(e.get("root_cause")) for e in stopping):
            f.problems.append(f"no group_stopping with root cause '{word}' for pid {root_pid}")

    def _check_flood(self, f: Fault) -> None:
        dirs = {e["dir"] for e in self.board.events_named("group_started")
                if f.victim in e["pids"].values()}
        last = f"flood {f.detail['tag']} {f.detail['lines'] - 1} ".encode()
        for d in dirs:
            log_file = Path(d) / str(f.detail["rank"]) / "stdout.log"
            if log_file.exists() and last in log_file.read_bytes():
                return
        f.problems.append(f"the flood's last line is not in rank {f.detail['rank']}'s stdout.log")

    def _check_diskfull(self, f: Fault) -> None:
        dirs = {e["dir"] for e in self.board.events_named("group_started")
                if f.victim in e["pids"].values()}
        last = f"flood {f.detail['tag']} 9 ".encode()
        for d in dirs:
            log_file = Path(d) / str(f.detail["rank"]) / "stdout.log"
            data = log_file.read_bytes() if log_file.exists() else b""
            end = data.find(last)
            if end >= 0 and data.rfind(LOST_MARKER, 0, end) >= 0:
                return
        f.problems.append(f"rank {f.detail['rank']}'s stdout.log has no lost-output marker "
                          "followed by the flood written after the disk was freed")

    def _check_frozen(self, f: Fault) -> None:
        # a worker of the frozen group may die later, by a later fault (a SIGSTOPped
        # worker's loop deadline expires): only an expiry between the freeze and the
        # group's answer to SIGUSR1 is this fault's doing
        until = f.detail.get("confirmed", math.inf)
        hung = [e for e in self.board.events_named("deadline_expired")
                if e.get("pid") in f.detail["pids"] and f.at <= e.get("mono", 0) <= until]
        if hung:
            f.problems.append(f"killed as hung after the freeze: {hung}")
        if b"event loop stalled" not in (self.root / "supervisor.err").read_bytes():
            f.problems.append("the supervisor did not report its stall")

    def check_attempt_dirs(self) -> None:
        for e in self.board.events_named("group_started"):
            for rank in range(self.args.workers):
                for name in ("stdout.log", "stderr.log"):
                    if not (Path(e["dir"]) / str(rank) / name).is_file():
                        self.violate(f"missing {e['dir']}/{rank}/{name}")

    # -- the whole run -------------------------------------------------------------
    async def run(self) -> Report:
        t0 = time.monotonic()
        tail = self.tail
        signalled = 0
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self.control)
                tg.start_soon(tail.run)
                await self.start_foreign()
                await self.start()
                await self.wait_health()
                await self.wait_group(0)
                self.guardian = self.find_guardian()
                await self.warm_up()
                until = time.monotonic() + self.args.seconds
                log(f"injecting faults for {self.args.seconds:g} s (seed {self.args.seed})")
                async with anyio.create_task_group() as inject:
                    inject.start_soon(self.background, self.fifo, 0.2, 1.2)
                    inject.start_soon(self.background, self.http_storm, 0.5, 2.5)
                    inject.start_soon(self.background, self.sighup, 2.0, 5.0)
                    try:
                        await self.main_loop(until)
                    finally:
                        self.stop_injecting.set()
                log("faults stopped; checking invariants")
                await self.final_checks()
                await self.stop_supervisor()
                tail.poll()
                await self.check_orphans()
                self.check_events()
                tg.cancel_scope.cancel()
        except* Exception as group:
            for exc in leaves(group):
                traceback.print_exception(exc, file=sys.stderr)
                self.violate(f"run aborted: {type(exc).__name__}: {exc}")
        finally:
            with anyio.CancelScope(shield=True):
                signalled = self.check_foreign()
                await self.cleanup()
            tail.close()
        return self.report(time.monotonic() - t0, signalled)

    async def cleanup(self) -> None:
        """Whatever happened: nothing of this run may outlive it."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        for pid in marked_processes(self.mark):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.foreign_procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        if self.etcd is not None:
            for member in self.etcd.members:  # continued first: a stopped one ignores TERM
                if member.process is not None and member.process.poll() is None:
                    member.process.send_signal(signal.SIGCONT)
            await anyio.to_thread.run_sync(self.etcd.close)
        if self.args.keep and self.log_tmpfs is not None:
            log(f"log tmpfs left mounted at {self.log_tmpfs} (--keep)")
        else:
            self.unmount_log_tmpfs()

    def report(self, wall: float, signalled: int) -> Report:
        table: dict[str, dict[str, int]] = {}
        for f in self.faults:
            row = table.setdefault(f.kind, {"injected": 0, "survived": 0, "violations": 0})
            row["injected"] += 1
            row["survived"] += int(f.observed and not f.problems)
            row["violations"] += len(f.problems)
        lat = sorted(self.http_latency) or [math.nan]
        return Report(
            seed=self.args.seed, seconds=self.args.seconds, workers=self.args.workers,
            faults=table, violations=self.violations,
            restarts=len(self.board.events_named("restart_scheduled")),
            attempts=len(self.board.events_named("group_started")),
            usage_start=asdict(self.usage_start) if self.usage_start else {},
            usage_end=asdict(self.usage_end) if self.usage_end else {},
            http_requests=sum(self.http_sent.values()),
            http_max_latency_ms=lat[-1] * 1000,
            http_p99_latency_ms=lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1000,
            fifo_lines=sum(self.fifo_expected.values()),
            orphans=len(self.orphans), foreign_signalled=signalled, wall=wall,
        )


def render(report: Report) -> str:
    lines = [
        f"chaos run: {report.seconds:g} s of faults (seed {report.seed}), {report.workers} "
        f"workers, {report.wall:.0f} s in all",
        "",
        "| fault | injected | survived | violations |",
        "|---|---|---|---|",
    ]
    for kind, row in sorted(report.faults.items()):
        lines.append(f"| {kind} | {row['injected']} | {row['survived']} | {row['violations']} |")
    total = {k: sum(r[k] for r in report.faults.values())
             for k in ("injected", "survived", "violations")}
    lines.append(f"| **all** | {total['injected']} | {total['survived']} | "
                 f"{len(report.violations)} |")
    s, e = report.usage_start, report.usage_end
    lines += [
        "",
        f"restarts: {report.restarts} ({report.attempts} attempts); HTTP requests: "
        f"{report.http_requests} (p99 {report.http_p99_latency_ms:.1f} ms, max "
        f"{report.http_max_latency_ms:.1f} ms); FIFO lines: {report.fifo_lines}",
        f"supervisor fds {s.get('fds')} -> {e.get('fds')}, threads {s.get('threads')} -> "
        f"{e.get('threads')}, RSS {s.get('rss_mb', 0):.1f} -> {e.get('rss_mb', 0):.1f} MB, "
        f"children {s.get('children')} -> {e.get('children')}",
        f"orphans after stop: {report.orphans}; foreign processes signalled: "
        f"{report.foreign_signalled}",
    ]
    if report.violations:
        lines += ["", "violations:"] + [f"- {v}" for v in report.violations]
    else:
        lines += ["", "violations: none"]
    return "\n".join(lines)


def main(argv: Iterable[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="how long to inject faults")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--max-restarts", type=int, default=100000)
    p.add_argument("--json", default=None, help="write the report as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the run directory")
    p.add_argument("--kinds", default="",
                   help="only these main-loop faults, comma-separated (e.g. frozen,diskfull)")
    p.add_argument("--disk-full", action="store_true",
                   help="put the logs on a tmpfs and inject 'diskfull' faults (needs root)")
    p.add_argument("--etcd", action="store_true",
                   help="run the etcd backend against a 3-member cluster and inject "
                        "'etcd-quorum' faults (needs Debian's etcd-server)")
    args = p.parse_args(list(argv) if argv is not None else None)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(10**6)
    chaos = Chaos(args)
    try:
        report = anyio.run(chaos.run)
    finally:
        if args.keep:
            log(f"run directory kept: {chaos.root}")
        else:
            shutil.rmtree(chaos.root, ignore_errors=True)
    print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=2))
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
