"""Chaos run infrastructure: the supervisor under test, its workers and foreign processes,
the board of what they reported, and clean-up (benchmarks/chaos.py runs it)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import anyio
import anyio.to_thread
import psutil
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.harness import REPO, log

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
FD_BOUND = 2  # "back within a small bound of the start", connections to etcd aside
# s the end check waits for the fds to come back: longer than aiohttp's idle keep-alive
# (TCPConnector's 15 s), since the etcd client's connections to the other members, opened
# while a quorum loss made it fail over, stay pooled that long (a run saw 43 -> 46 fds
# 10 s after an outage; a 40 s run with 4 outages ended at 44: pooled, not leaked)
FD_SETTLE = 20.0
# Open connections to etcd members are bounded apart: each watch keeps streams on two
# members, and the members it probes and sends requests to keep a pooled connection each
# busy, so where the streams stand after the outages moves connections between members
# and the count by up to one per member (runs of 15 s with 2-3 quorum losses ended at -3
# to +3 against the baseline). A connection etcd closed and the supervisor did not
# (CLOSE_WAIT) is a leak whatever the count.
# The pool also keeps what a burst of requests grew it to: aiohttp (3.14) reuses its idle
# connections oldest first, so with a request every TTL/3 (the lease keepalive) or sooner
# each stays warm and none idles out. Four chaos runs at once on two cores (HTTP p99
# 400-650 ms) ended 3 times in 32 at +4 (7 -> 11, 8 -> 12) after crashes and quorum
# losses mixed, never more; 12 runs of quorum losses alone (5 each) stayed within +3. A
# leak grows with the faults: a soak's 60 and more restarts exceed this bound at once.
ETCD_POOL_BOUND_PER_MEMBER = 2
THREAD_BOUND = 2
RSS_BOUND_MB = 10.0

WORKER = r'''
import os, signal, socket, subprocess, sys, time

CTL = os.environ["CHAOS_CTL"]
CMD = os.environ["CHAOS_CMD"]
rank = int(os.environ["LOCAL_RANK"])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
pending = []
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # blocking: a message waits
# for room in the harness's queue (10 datagrams) rather than being dropped, which would
# leave the harness waiting for a group that came up


def send(text):
    try:
        sock.sendto(text.encode(), CTL)
    except OSError as exc:  # the harness is gone: said on the worker's stderr
        print(f"chaos worker: cannot report {text.split()[0]!r}: {exc}", file=sys.stderr)


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
    # what each fd is (sockets with their addresses and state): names the fds a violation
    # is about; left out of the log line and the report
    fd_kinds: list[str] = field(default_factory=list, repr=False)

    @classmethod
    def of(cls, pid: int, workers: set[int]) -> Usage:
        """``workers``: the current group's pids (a warm worker keeps its standby's
        command line)."""
        proc = psutil.Process(pid)
        kinds = fd_kinds(proc)
        return cls(
            fds=len(kinds),
            fd_kinds=kinds,
            threads=len(os.listdir(f"/proc/{pid}/task")),
            rss_mb=proc.memory_info().rss / 1e6,
            # standbys come and go with attempts (one per rank while a restart is possible)
            children=len([c for c in proc.children()
                          if c.pid in workers or not is_standby(c)]),
        )


def fd_kinds(proc: psutil.Process) -> list[str]:
    """One line per open fd: an inet socket's peer (or address, unconnected) and state, else
    the link's target (without what differs from one moment to the next: pipe and socket
    inodes, attempt numbers)."""
    inet = {}
    with contextlib.suppress(psutil.Error):
        for c in proc.net_connections(kind="inet"):
            proto = "tcp" if c.type == socket.SOCK_STREAM else "udp"
            if c.raddr:
                inet[c.fd] = f"{proto} to {c.raddr.ip}:{c.raddr.port} {c.status}"
            else:
                inet[c.fd] = f"{proto} on {c.laddr.ip}:{c.laddr.port} {c.status}"
    out = []
    for fd in os.listdir(f"/proc/{proc.pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{proc.pid}/fd/{fd}")
            if target == "anon_inode:[pidfd]":
                target += " live" if pidfd_target_lives(proc.pid, fd) else " exited"
            elif not target.startswith("anon_inode:"):  # whose [...] names a kind
                target = re.sub(r"attempt_\d+", "attempt_N", target.split(":[")[0])
            out.append(inet.get(int(fd)) or target)
    return sorted(out)


def pidfd_target_lives(pid: int, fd: str) -> bool:
    """Whether the process a pidfd of ``pid`` refers to is still there (fdinfo's ``Pid:``
    is -1 once it has been reaped)."""
    with open(f"/proc/{pid}/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("Pid:"):
                target = int(line.split()[1])
                return target > 0 and proc_state(target) not in (None, "Z")
    return False


def live_pidfds(usage: Usage) -> int:
    """How many of ``usage``'s fds are pidfds of processes alive: the deadline FIFO's owner
    cache keeps one per process that wrote to it while that process lives (bounded)."""
    return usage.fd_kinds.count("anon_inode:[pidfd] live")


def etcd_connections(usage: Usage, members: set[str]) -> int:
    """How many of ``usage``'s fds are open connections to an etcd member (``host:port``)."""
    return sum(1 for kind in usage.fd_kinds
               if kind.startswith("tcp to ") and kind.split()[2] in members)


def fd_change(start: Usage, end: Usage) -> str:
    """The fds open at the end and not at the start, and those gone, one per line."""
    diff = Counter(end.fd_kinds)
    diff.subtract(Counter(start.fd_kinds))
    return "; ".join(f"{n:+d} {kind}" for kind, n in sorted(diff.items()) if n)


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
    http_timeouts_across_freezes: int  # not violations: the supervisor was SIGSTOPped
    fifo_lines: int
    orphans: int
    foreign_signalled: int
    wall: float


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
    """Follows ``events.jsonl`` across renames (logrotate + SIGHUP), feeding the board.

    The supervisor reopens its log off the event loop: the new file exists a moment before
    it stops writing to the renamed one, so a renamed file stays open and is drained on
    every poll until the tail closes."""

    def __init__(self, path: Path, board: Board) -> None:
        self.path = path
        self.board = board
        self._file: Any = None
        self._buf = b""
        self._renamed: list[tuple[Any, list[bytes]]] = []  # (file, [its partial line])

    def _open(self) -> bool:
        try:
            self._file = open(self.path, "rb")  # noqa: SIM115 - held across polls
        except FileNotFoundError:
            return False
        return True

    def poll(self) -> None:
        for old, buf in self._renamed:
            self._drain(old, buf)
        if self._file is None and not self._open():
            return
        current = [self._buf]
        self._drain(self._file, current)
        self._buf = current[0]
        try:
            renamed = os.stat(self.path).st_ino != os.fstat(self._file.fileno()).st_ino
        except FileNotFoundError:
            renamed = False  # renamed, new one not made yet: keep reading the old one
        if renamed:
            self._renamed.append((self._file, [self._buf]))
            self._file = None
            self._buf = b""
            if self._open():
                self.poll()

    def _drain(self, file: Any, buf: list[bytes]) -> None:
        data = file.read()
        if not data:
            return
        *lines, buf[0] = (buf[0] + data).split(b"\n")
        for line in lines:
            if line.strip():
                self.board.event(json.loads(line))
        self.board.changed()

    async def run(self) -> None:
        while True:
            self.poll()
            await anyio.sleep(0.02)  # pacing: a file has no readiness to wait on

    def close(self) -> None:
        for old, _ in self._renamed:
            old.close()
        self._renamed.clear()
        if self._file is not None:
            self._file.close()


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


def describe_process(pid: int) -> str:
    """State, wait channel and command line of a process, for a diagnosis."""
    try:
        proc = Path(f"/proc/{pid}")
        wchan = (proc / "wchan").read_text()
        cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    return f"state {proc_state(pid)}, wchan {wchan or '-'}, cmdline {cmdline.strip()[:160]!r}"


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


class Rig:
    """One supervisor under test and everything around it; faults and checks act through it."""

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
        self.etcd: Any = None  # tests.support.etcd.EtcdFactory with --etcd
        self.freeze_epoch = 0  # counts SIGSTOPs and SIGCONTs of the supervisor
        self.http_timeouts_across_freezes = 0  # requests that waited through a freeze
        self.fifo_quiet = anyio.Lock()  # held by a FIFO fault, or by a freeze

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
            from tests.support.etcd import EtcdFactory

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

    async def find_guardian(self) -> int:
        """The supervisor's one child that is neither a worker nor a standby interpreter
        (call while the group is up). A standby being spawned shows ``setpriv``'s command
        line until it has exec'd its interpreter: asked again until one child is left
        (a CI run saw two for a moment)."""
        workers = {pid for group in self.board.ready.values() for pid, _ in group.values()}
        others: list[int] = []
        with anyio.move_on_after(5):
            while True:
                others = [c.pid for c in psutil.Process(self.pid).children()
                          if c.pid not in workers and not is_standby(c)]
                if len(others) == 1:
                    break
                await anyio.sleep(0.05)  # pacing: a spawn's exec takes milliseconds
        if len(others) != 1:
            raise RuntimeError(f"expected one guardian process, found {others}")
        return others[0]

    def group_up(self, restart: int) -> bool:
        """Every worker of the attempt with that restart count reported ready."""
        workers: int = self.args.workers
        return len(self.board.ready.get(restart, {})) == workers

    async def wait_group(self, restart: int) -> None:
        try:
            await self.board.wait_for(f"group {restart} up", lambda: self.group_up(restart))
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; {self.group_diagnosis(restart)}") from None

    def group_diagnosis(self, restart: int) -> str:
        """What a group that never came up was doing: the ranks that reported, the pids its
        ``group_started`` event named with each process's state, kernel wait channel and
        command line, and the supervisor's last lines (a CI run once saw group 7 start
        but never report, and said no more)."""
        reported = sorted(self.board.ready.get(restart, {}))
        lines = [f"ranks that reported: {reported}"]
        started = [e for e in self.board.events_named("group_started")
                   if int(e["restart_count"]) == restart]
        lines.append(f"group_started events for restart {restart}: {len(started)}")
        if started:
            for rank, pid in sorted(started[-1].get("pids", {}).items()):
                lines.append(f"  rank {rank} pid {pid}: {describe_process(int(pid))}")
        scheduled = self.board.events_named("restart_scheduled")
        lines.append(f"last restart_scheduled: {scheduled[-1] if scheduled else None}")
        lines.append(f"last events: {[e['event'] for e in self.board.events[-12:]]}")
        try:
            tail = (self.root / "supervisor.err").read_text(errors="replace").splitlines()[-25:]
        except OSError as err:
            tail = [f"(supervisor.err unreadable: {err})"]
        lines.append("supervisor.err, last lines:")
        lines.extend(f"  {line}" for line in tail)
        return "\n".join(lines)

    def etcd_members(self) -> set[str]:
        """The etcd members' client addresses (``host:port``); none without ``--etcd``."""
        if self.etcd is None:
            return set()
        return {urlsplit(m.endpoint).netloc for m in self.etcd.members}

    def worker_pids(self) -> set[int]:
        return {pid for pid, _ in self.board.ready.get(self.board.restart, {}).values()}

    def current(self) -> tuple[int, dict[int, tuple[int, int]]]:
        r = self.board.restart
        return r, self.board.ready[r]

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

    def stderr_count(self, text: str) -> int:
        """How many times the supervisor's log (a file here) has said ``text``."""
        return (self.root / "supervisor.err").read_bytes().count(text.encode())

    async def wait_stderr(self, text: str, times: int) -> None:
        """Until the supervisor's log has said ``text`` ``times`` times."""
        with anyio.fail_after(WAIT):
            while self.stderr_count(text) < times:
                await anyio.sleep(0.05)  # pacing: a file announces nothing

    async def probe(self, session: aiohttp.ClientSession, method: str, path: str) -> int | None:
        label = path.split("?")[0]
        started, epoch = time.monotonic(), self.freeze_epoch
        try:
            async with session.request(method, self.url + path,
                                       timeout=aiohttp.ClientTimeout(total=10)) as resp:
                await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            if isinstance(exc, TimeoutError) and (epoch != self.freeze_epoch or epoch % 2):
                # the supervisor was SIGSTOPped for part of it (two ``frozen`` faults in a
                # row stop it 2 x FREEZE s, the timeout's length): a request that follows
                # any freeze still has to answer in time
                self.http_timeouts_across_freezes += 1
                return None
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

    async def settle(self) -> None:
        """Group running and /readyz 200; connections closed."""
        await self.wait_group(self.board.restart)
        async with aiohttp.ClientSession() as session:
            with anyio.fail_after(WAIT):
                while await self.probe(session, "GET", "/readyz") != 200:
                    await anyio.sleep(0.1)  # pacing: readiness is computed per probe

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
