"""Multi-node rendezvous on one machine: elastic-supervisor (etcd or c10d) vs torchrun (c10d).

    python benchmarks/rendezvous_bench.py [--sizes 2,4,8,16] [--reps 3] [--quick]
                                          [--only formation|scale_up|node_loss]
                                          [--lease-ttl 2] [--scale-window 20]
                                          [--loss-window 10] [--no-torchrun] [--json FILE]
                                          [--ours-backend etcd|c10d]

``--ours-backend c10d`` runs ours with exactly torchrun's command line (``--rdzv-backend
c10d --rdzv-endpoint 127.0.0.1:PORT --rdzv-conf last_call_timeout=1``): no etcd is started
beforehand, the first of our agents to bind the port hosts a single-member etcd as its
child, and "spawn -> all up" includes starting it. Its default scenarios are formation and
scale-up (``--lease-ttl`` does not apply: the command line is torchrun's).

Every agent is a real launcher process with its own log dir and one worker
(``--nproc-per-node 1``); ours talk to one local etcd (fast raft timings), torchrun's to
the c10d TCPStore that its first agent hosts on ``127.0.0.1:PORT``. Both get
``last_call_timeout=1``. The worker is a tiny script whose first line prints
``up RANK WORLD_SIZE RESTART_COUNT MONO`` (``time.monotonic()``, one clock for every process
on Linux). Scenarios, each run with N agents for every N in ``--sizes``:

- **formation** (``--nnodes N``): spawn N agents back to back; *start -> all up* is the
  first spawn -> the last worker's first line (includes each launcher's start-up: torchrun
  imports torch); *last join -> complete* is the last agent to begin its rendezvous -> the
  last agent to finish it (the protocol alone). Begin/finish marks: ours, the event log
  (``supervisor_started``: lease taken, about to join; ``rendezvous``); torchrun, its INFO
  log (``Rendezvous'ing worker group``, ``Rendezvous complete``; wall clock, ms resolution,
  converted to the monotonic clock).
- **scale-up** (``--nnodes N:N+1``, N running): spawn one more agent; *join -> noticed*
  is the joiner's begin mark -> each running agent's detection (ours: ``membership_changed``
  in its event log; torchrun: ``Detected 1 new nodes``, found by its 0.1 s monitor poll),
  median over the running agents; *join -> all up* is the joiner's begin mark -> the last
  worker of the N+1-node round up, given ``--scale-window`` seconds. (torchrun 2.13's
  c10d round with the joiner hung in rank assignment on every try here; once it hangs at
  some N, that N is not tried again.)
- **node loss** (``--nnodes N-1:N``, N running): SIGKILL one agent and its workers (a node
  crash); *-> noticed* is the median over the survivors of the kill -> detection, *-> all
  up* the kill -> the last survivor's new worker up. Ours notices when the dead agent's
  lease expires (``--lease-ttl``). The victim is never torchrun's store host (its loss
  ends the whole job). torchrun's agents never look for lost nodes while their workers
  run (only for waiting ones; a real job notices through its collectives timing out): it
  is tried once, at the smallest N, for ``--loss-window`` seconds.

A full run (2-16 agents, 3 repetitions) takes about 8 minutes on 2 cores; ``--quick``
about 2.

Progress goes to stderr, a Markdown table (medians, min-max, ratio torchrun / ours) to
stdout. Every agent runs in its own session; clean-up kills every agent, every process
any of them started (psutil) and etcd, even when a run fails.
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
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import psutil

from benchmarks.harness import free_port, log

BIN = Path(sys.executable).parent
POLL = 0.02  # s between looks at the agents' files; timings come from the records themselves
LAST_CALL = 1  # s, both launchers (torchrun wants an integer)
WORKER = """\
import os, sys, time
T = time.monotonic()
e = os.environ
os.write(1, f"up {e['RANK']} {e['WORLD_SIZE']} {e['TORCHELASTIC_RESTART_COUNT']} {T:.6f}\\n"
         .encode())
if sys.argv[1:] == ["hang"]:
    while True:
        time.sleep(3600)
"""
TORCH_LOG = re.compile(r"^[IWE](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) ")


class BenchError(RuntimeError):
    """A run did not do what it should (timeout, early exit)."""




def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(POLL)


# ------------------------------------------------------------------ etcd


class Etcd:
    """One local etcd member with fast raft timings; ``close()`` stops it."""

    def __init__(self, root: Path) -> None:
        exe = shutil.which("etcd")
        if exe is None:
            raise SystemExit("etcd is not installed (apt-get install etcd-server)")
        client, peer = free_port(), free_port()
        self.endpoint = f"http://127.0.0.1:{client}"
        peer_url = f"http://127.0.0.1:{peer}"
        with open(root / "etcd.log", "wb") as out:
            self.proc = subprocess.Popen(
                [exe, "--name", "bench", "--data-dir", str(root / "etcd"),
                 "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
                 "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                 "--initial-cluster", f"bench={peer_url}",
                 "--heartbeat-interval", "10", "--election-timeout", "100"],
                stdout=out, stderr=out, start_new_session=True)
        wait_for(self._healthy, 15, "etcd to become healthy")

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise BenchError("etcd exited at start")
        try:
            with urllib.request.urlopen(self.endpoint + "/health", timeout=1) as resp:
                return bool(json.load(resp).get("health") == "true")
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ------------------------------------------------------------------ agents


@dataclass(frozen=True)
class Up:
    """One worker's first line."""

    rank: int
    world: int
    restart: int
    mono: float


class Agent:
    """One launcher process (one node) with its files under ``root``."""

    def __init__(self, kind: str, root: Path, argv: list[str], env: dict[str, str]) -> None:
        self.kind = kind
        self.root = root
        root.mkdir(parents=True)
        with open(root / "out", "wb") as out, open(root / "err", "wb") as err:
            self.spawned = time.monotonic()
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                         env=env, cwd=root, start_new_session=True)
        self.seen: dict[int, psutil.Process] = {}

    def ups(self) -> list[Up]:
        found = []
        for line in (self.root / "out").read_text(errors="replace").splitlines():
            parts = line.split()
            if len(parts) == 5 and parts[0] == "up":
                found.append(Up(int(parts[1]), int(parts[2]), int(parts[3]), float(parts[4])))
        return found

    # marks on the monotonic clock: ours from events.jsonl, torchrun from its INFO log
    def events(self, kind: str) -> list[float]:
        path = next((self.root / "logs").glob("*/events.jsonl"), None)
        if path is None:
            return []
        marks = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if record["event"] == kind:
                    marks.append(float(record["mono"]))
        return marks

    def torch_marks(self, needle: str) -> list[float]:
        marks = []
        for line in (self.root / "err").read_text(errors="replace").splitlines():
            m = TORCH_LOG.match(line)
            if m and needle in line:
                month, day, hh, mm, ss, us = map(int, m.groups())
                now = datetime.now()
                wall = datetime(now.year, month, day, hh, mm, ss, us).timestamp()
                marks.append(wall - WALL_MINUS_MONO)
        return marks

    def begun(self) -> list[float]:
        """When it began (each) rendezvous."""
        if self.kind == "ours":
            return self.events("supervisor_started")
        return self.torch_marks("Rendezvous'ing worker group")

    def completed(self) -> list[float]:
        if self.kind == "ours":
            return self.events("rendezvous")
        return self.torch_marks("Rendezvous complete for workers")

    def noticed(self) -> list[float]:
        """Membership changes it noticed while its workers ran."""
        if self.kind == "ours":
            return self.events("membership_changed")
        return self.torch_marks("new nodes from group_rank")

    def listens_on(self, port: int) -> bool:
        """The agent (torchrun's store) or a child of it (our c10d etcd) listens on port."""
        self.remember()
        for proc in [psutil.Process(self.proc.pid), *self.seen.values()]:
            with contextlib.suppress(psutil.Error):
                if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                       for c in proc.net_connections("tcp")):
                    return True
        return False

    def remember(self) -> None:
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(p.pid, p)

    def crash(self) -> None:
        """SIGKILL the agent and everything it started at once: a node dies."""
        self.remember()
        self.proc.kill()
        for p in self.seen.values():
            with contextlib.suppress(psutil.Error):
                p.kill()
        self.proc.wait()

    def terminate(self) -> None:
        self.remember()
        if self.proc.poll() is None:
            self.proc.terminate()

    def close(self, deadline: float) -> None:
        """After ``terminate()``: wait until ``deadline``, then kill it and all it started."""
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for p in self.seen.values():
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(list(self.seen.values()), timeout=5)

    def tail(self) -> str:
        lines = (self.root / "err").read_text(errors="replace").splitlines()
        return " | ".join(lines[-4:])


WALL_MINUS_MONO = time.time() - time.monotonic()


@dataclass
class Fleet:
    """The agents of one job."""

    kind: str
    root: Path
    nnodes: str
    mode: str  # worker: "exit" or "hang"
    etcd: Etcd | None
    lease_ttl: int
    backend: str = "etcd"  # ours: etcd (a local etcd started first) or c10d (torchrun's line)
    run_id: str = field(default_factory=lambda: f"bench-{os.urandom(4).hex()}")
    agents: list[Agent] = field(default_factory=list)
    port: int = field(default_factory=free_port)

    def argv(self, index: int) -> list[str]:
        common = ["--rdzv-id", self.run_id, "--nnodes", self.nnodes, "--nproc-per-node", "1",
                  "--log-dir", str(self.root / f"a{index}" / "logs")]
        worker = [str(self.root / "worker.py"), self.mode]
        c10d = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}",
                "--rdzv-conf", f"last_call_timeout={LAST_CALL}"]
        if self.kind == "ours":
            exe = BIN / "elastic-supervisor"
            cmd = [str(exe), "run"] if exe.exists() else [sys.executable, "-m", "supervisor", "run"]
            if self.backend == "c10d":
                return [*cmd, *common, *c10d, "--health-port", "0", *worker]
            assert self.etcd is not None
            return [*cmd, *common, "--rdzv-backend", "etcd", "--rdzv-endpoint", self.etcd.endpoint,
                    "--rdzv-conf", f"last_call_timeout={LAST_CALL},lease_ttl={self.lease_ttl}",
                    "--health-port", "0", *worker]
        exe = BIN / "torchrun"
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
        return [*cmd, *common, *c10d, *worker]

    def spawn(self, count: int = 1) -> list[Agent]:
        made = []
        for _ in range(count):
            index = len(self.agents)
            agent = Agent(self.kind, self.root / f"a{index}", self.argv(index), agent_env())
            self.agents.append(agent)
            made.append(agent)
        return made

    def wait_round(self, agents: Sequence[Agent], world: int, timeout: float,
                   after: float = 0.0) -> list[Up]:
        """Each agent's first worker up in a round of ``world`` workers (after ``after``)."""
        found: dict[int, Up] = {}

        def check() -> bool:
            for i, agent in enumerate(agents):
                if i not in found:
                    ups = [u for u in agent.ups() if u.world == world and u.mono > after]
                    if ups:
                        found[i] = ups[0]
                    elif agent.proc.poll() is not None:
                        raise BenchError(f"{self.kind} agent exited early: {agent.tail()}")
            return len(found) == len(agents)

        wait_for(check, timeout, f"{len(agents)} {self.kind} agents to run a round of {world}")
        for agent in agents:
            agent.remember()
        return [found[i] for i in range(len(agents))]

    def close(self) -> None:
        """SIGTERM every agent at once, give them 10 s together, then kill what is left."""
        for agent in self.agents:
            agent.terminate()
        deadline = time.monotonic() + 10
        for agent in self.agents:
            agent.close(deadline)


def agent_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "TORCHELASTIC_", "SUPERVISOR_"))
           and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", LOGLEVEL="INFO")  # torchrun logs its marks at INFO
    return env


@contextlib.contextmanager
def fleet(kind: str, root: Path, nnodes: str, mode: str, etcd: Etcd | None,
          lease_ttl: int) -> Iterator[Fleet]:
    made = Fleet(kind, Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=root)), nnodes, mode, etcd,
                 lease_ttl, OURS_BACKEND)
    (made.root / "worker.py").write_text(WORKER)
    try:
        yield made
    finally:
        made.close()
        if not os.environ.get("BENCH_KEEP"):
            shutil.rmtree(made.root, ignore_errors=True)


# ------------------------------------------------------------------ scenarios

Sample = dict[str, float]


def formation(kind: str, n: int, root: Path, etcd: Etcd | None, ttl: int) -> Sample:
    with fleet(kind, root, str(n), "exit", etcd, ttl) as f:
        agents = f.spawn(n)
        ups = f.wait_round(agents, n, timeout=60 + 5 * n)
        t0 = agents[0].spawned
        begun = [a.begun()[0] for a in agents]
        done = [a.completed()[0] for a in agents]
        for agent in agents:
            agent.proc.wait(60)
        return {"start_all_up": max(u.mono for u in ups) - t0,
                "last_join_complete": max(done) - max(begun)}


def scale_up(kind: str, n: int, root: Path, etcd: Etcd | None, ttl: int,
             window: float) -> Sample:
    with fleet(kind, root, f"{n}:{n + 1}", "hang", etcd, ttl) as f:
        running = f.spawn(n)
        f.wait_round(running, n, timeout=60 + 5 * n)
        (joiner,) = f.spawn()
        try:
            ups = f.wait_round(f.agents, n + 1, timeout=window)
            all_up = max(u.mono for u in ups)
        except BenchError as exc:  # torchrun's c10d round with the joiner can hang here
            log(f"  {kind} N={n}: the {n + 1}-node round did not run: {exc}")
            all_up = float("inf")
        joined = joiner.begun()[0]
        noticed = [min((t for t in a.noticed() if t > joined), default=float("inf")) - joined
                   for a in running]
        return {"join_noticed": statistics.median(noticed),
                "join_all_up": all_up - joined,
                "spawn_all_up": all_up - joiner.spawned}


def node_loss(kind: str, n: int, root: Path, etcd: Etcd | None, ttl: int,
              window: float) -> Sample:
    with fleet(kind, root, f"{n - 1}:{n}", "hang", etcd, ttl) as f:
        agents = f.spawn(n)
        f.wait_round(agents, n, timeout=60 + 5 * n)
        # not the agent hosting torchrun's c10d store: its loss ends the job, not a node
        victim = next(a for a in reversed(agents) if not a.listens_on(f.port))
        survivors = [a for a in agents if a is not victim]
        killed = time.monotonic()
        victim.crash()
        try:
            ups = f.wait_round(survivors, n - 1, timeout=window, after=killed)
        except BenchError:
            if any(a.noticed() or a.proc.poll() is not None for a in survivors):
                raise
            return {"loss_noticed": float("inf"), "loss_all_up": float("inf")}
        noticed = [min(t for t in a.noticed() if t > killed) - killed for a in survivors]
        return {"loss_noticed": statistics.median(noticed),
                "loss_all_up": max(u.mono for u in ups) - killed}


# ------------------------------------------------------------------ report

ROWS = [
    ("formation", "start_all_up", "formation: spawn -> all workers up"),
    ("formation", "last_join_complete", "formation: last join -> round complete"),
    ("scale_up", "join_noticed", "scale-up: join -> running agents notice"),
    ("scale_up", "join_all_up", "scale-up: join -> all N+1 workers up"),
    ("scale_up", "spawn_all_up", "scale-up: joiner spawned -> all N+1 workers up"),
    ("node_loss", "loss_noticed", "node loss (SIGKILL): -> survivors notice"),
    ("node_loss", "loss_all_up", "node loss (SIGKILL): -> survivors' workers up"),
]
KINDS = ("ours", "torchrun")
OURS_BACKEND = "etcd"  # set by --ours-backend
Results = dict[str, dict[str, dict[int, list[Sample]]]]  # scenario -> kind -> N -> samples


def cell(values: list[float], window: float) -> str:
    if not values:
        return "-"
    misses = sum(v == float("inf") for v in values)
    if misses:
        return f"none within {window:g} s ({misses} of {len(values)} runs)"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.3f}"
    return f"{med:.3f} ({min(values):.3f}-{max(values):.3f})"


def table(results: Results, windows: dict[str, float]) -> str:
    lines = [f"| measurement (s) | N | elastic-supervisor ({OURS_BACKEND}) | torchrun (c10d) | "
             "torchrun / ours |", "|---|---|---|---|---|"]
    for scenario, key, label in ROWS:
        sizes = sorted({n for kind in KINDS for n in results.get(scenario, {}).get(kind, {})})
        window = windows[scenario]
        for n in sizes:
            vals = {kind: [s[key] for s in results[scenario].get(kind, {}).get(n, [])]
                    for kind in KINDS}
            ours, theirs = vals["ours"], vals["torchrun"]
            ratio = "-"
            if ours and theirs and float("inf") not in theirs + ours:
                ratio = f"{statistics.median(theirs) / statistics.median(ours):.1f}x"
            lines.append(f"| {label} | {n} | {cell(ours, window)} | {cell(theirs, window)} "
                         f"| {ratio} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="2,4,8,16", help="agent counts, comma-separated")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="sizes 2,4 and one repetition")
    p.add_argument("--lease-ttl", type=int, default=2, help="ours: lease TTL (s)")
    p.add_argument("--loss-window", type=float, default=10.0,
                   help="how long survivors get to notice a lost node (s)")
    p.add_argument("--scale-window", type=float, default=20.0,
                   help="how long the N+1-node round gets to run after a join (s)")
    p.add_argument("--only", action="append", choices=["formation", "scale_up", "node_loss"])
    p.add_argument("--no-torchrun", action="store_true")
    p.add_argument("--json", default=None, help="write the raw samples here")
    p.add_argument("--ours-backend", choices=["etcd", "c10d"], default="etcd",
                   help="ours against a local etcd, or with torchrun's own c10d command line")
    args = p.parse_args()
    global OURS_BACKEND
    OURS_BACKEND = args.ours_backend
    sizes = [2, 4] if args.quick else [int(x) for x in args.sizes.split(",")]
    reps = 1 if args.quick else args.reps
    kinds = ("ours",) if args.no_torchrun else KINDS
    default = ["formation", "scale_up"] if OURS_BACKEND == "c10d" else \
        ["formation", "scale_up", "node_loss"]
    scenarios = args.only or default
    results: Results = {s: {k: {} for k in KINDS} for s in scenarios}
    root = Path(tempfile.mkdtemp(prefix="bench-rdzv-"))
    etcd = Etcd(root) if OURS_BACKEND == "etcd" else None
    ttl = args.lease_ttl
    stuck: set[tuple[str, str, int]] = set()
    try:
        for scenario in scenarios:
            for n in sizes:
                for rep in range(reps):
                    order = kinds if rep % 2 == 0 else tuple(reversed(kinds))
                    for kind in order:
                        if scenario == "node_loss" and kind == "torchrun" and (
                                n != sizes[0] or rep > 0):
                            continue  # it never notices: one demonstration is enough
                        if (scenario, kind, n) in stuck:
                            continue  # the bigger round hung once: do not wait on it again
                        started = time.monotonic()
                        if scenario == "formation":
                            sample = formation(kind, n, root, etcd, ttl)
                        elif scenario == "scale_up":
                            sample = scale_up(kind, n, root, etcd, ttl, args.scale_window)
                        else:
                            sample = node_loss(kind, n, root, etcd, ttl, args.loss_window)
                        results[scenario][kind].setdefault(n, []).append(sample)
                        if sample.get("join_all_up") == float("inf"):
                            stuck.add((scenario, kind, n))
                        shown = ", ".join(f"{k}={v:.3f}" for k, v in sample.items())
                        log(f"{scenario} {kind} N={n} rep {rep}: {shown} "
                            f"({time.monotonic() - started:.1f} s)")
    finally:
        if etcd is not None:
            etcd.close()
        if not os.environ.get("BENCH_KEEP"):
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    same = "the same c10d command line" if OURS_BACKEND == "c10d" else f"ours lease_ttl={ttl} s"
    print(f"Rendezvous on one machine ({os.cpu_count()} CPUs), 1 worker per agent, "
          f"last_call_timeout={LAST_CALL} s for both, {same}; "
          f"median (min-max) of {reps} run(s)\n")
    windows = {"formation": 0.0, "scale_up": args.scale_window, "node_loss": args.loss_window}
    print(table(results, windows))


if __name__ == "__main__":
    main()
