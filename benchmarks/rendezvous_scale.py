"""The etcd rendezvous at scale: N participants against one real etcd on this machine.

    python benchmarks/rendezvous_scale.py [--sizes 16,64,256,1024] [--procs 4]
                                          [--lease-ttl 10] [--idle 30] [--json FILE]
                                          [--keep]

Every participant is the project's own ``EtcdRendezvous`` (the class the supervisor uses),
running the supervisor's loop: ``next_round`` -> ``wait_membership_change`` -> again. They
live many per process in ``--procs`` agent processes (this file with ``--agent``), plus one
process holding a single participant that is SIGKILLed (a node crash). One etcd (fresh data
dir, free ports, ``--heartbeat-interval 10 --election-timeout 100``) serves every N in turn,
each N under its own run id. Phases, each N in one run (config: ``min_nodes`` N-2,
``max_nodes`` N, ``last_call_timeout`` 30 s, which no phase may wait for):

- **setup**: every participant takes its lease, opens its control watch and campaigns
  for the leader key (a supervisor's start-up); not part of formation.
- **formation**: at one instant every participant calls ``next_round``; *last join ->
  all have it* is the last join key committed -> the last participant holding the round;
  *start -> complete* is the instant -> the last participant holding it.
- **loss**: SIGKILL the single-participant process; *noticed - TTL* is the kill -> the last
  survivor's ``wait_membership_change`` returning, minus the lease TTL (the wait for the
  lease to expire dominates); *reformed - TTL* -> the last survivor in the next round.
- **leave**: one participant calls ``leave()`` (SIGTERM's path); *noticed*, *reformed*.
- **scale-up**: one new participant joins the running job; *noticed* is its wait key
  committed -> the last member noticing, *reformed* -> every one (it included) in the round.
- **idle**: the job sits for ``--idle`` seconds; requests per participant per minute.

Per phase the table gives etcd requests per participant (mean over the non-leaders, and
the leader's own), txn conflicts, failed attempts (retries) and watch events, counted by
each participant's ``EtcdClient.stats``. Progress goes to stderr, Markdown to stdout.
The soft RLIMIT_NOFILE is raised to the hard limit (etcd inherits it); clean-up kills every
agent process and etcd, even when a run fails. Each phase is bounded (``PHASE_TIMEOUT``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness import REPO, free_port, log

PHASE_TIMEOUT = 120.0  # s, any phase at any N
NODE = "n{:05d}"
VERBOSE = bool(os.environ.get("SCALE_VERBOSE"))




def raise_nofile() -> tuple[int, int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


# ------------------------------------------------------------------ agent process


async def agent_main(args: argparse.Namespace) -> None:
    """Run ``args.count`` participants; obey commands on stdin, report on stdout."""
    import anyio

    from supervisor.rendezvous.etcd.backend import EtcdRendezvous
    from supervisor.rendezvous.etcd.config import EtcdRendezvousConfig

    raise_nofile()
    import logging

    class Mono(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            record.mono = time.monotonic()
            return True

    handler = logging.StreamHandler()
    handler.addFilter(Mono())
    handler.setFormatter(logging.Formatter("%(mono).3f %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        handlers=[handler])

    def say(**record: Any) -> None:
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()

    def make(node: str) -> EtcdRendezvous:
        return EtcdRendezvous(EtcdRendezvousConfig(
            endpoints=(args.endpoint,), run_id=args.run_id, node_id=node,
            min_nodes=max(args.total - 2, 1), max_nodes=args.total, last_call_timeout=30,
            lease_ttl=args.ttl, join_timeout=PHASE_TIMEOUT, request_timeout=5))

    rdzvs: dict[str, EtcdRendezvous] = {}
    loops: dict[str, anyio.CancelScope] = {}
    go = anyio.Event()

    async def loop(rdzv: EtcdRendezvous, scope: anyio.CancelScope) -> None:
        with scope:
            await go.wait()
            while True:
                result = await rdzv.next_round(1)
                say(ev="round", node=rdzv.node_id, round=result.round, t=time.monotonic(),
                    joined=rdzv.joined_at, waited=rdzv.waited_at,
                    size=result.group_world_size)
                reason = await rdzv.wait_membership_change(result)
                say(ev="notice", node=rdzv.node_id, round=result.round, t=time.monotonic(),
                    reason=reason)

    async def start(tg: Any, node: str) -> None:
        rdzv = make(node)
        rdzvs[node] = rdzv
        await tg.start(rdzv.run)
        loops[node] = anyio.CancelScope()
        tg.start_soon(loop, rdzv, loops[node])

    fds_before = len(os.listdir("/proc/self/fd"))
    async with anyio.create_task_group() as tg:
        started = time.monotonic()
        async with anyio.create_task_group() as setup:
            for i in range(args.offset, args.offset + args.count):
                setup.start_soon(start, tg, NODE.format(i))
        fds = len(os.listdir("/proc/self/fd")) - fds_before
        say(ev="ready", t=time.monotonic(), setup=time.monotonic() - started,
            fds_per_participant=fds / max(args.count, 1))
        stdin = anyio.wrap_file(sys.stdin)
        async for line in stdin:
            cmd, *rest = line.split()
            if cmd == "go":
                await anyio.sleep_until(float(rest[0]))
                go.set()
            elif cmd == "stats":
                say(ev="stats", stats={n: r.stats for n, r in rdzvs.items()},
                    leader={n: r.lease_id == _leader_lease(r) for n, r in rdzvs.items()})
            elif cmd == "leave":
                loops[rest[0]].cancel()
                say(ev="leaving", node=rest[0], t=time.monotonic())
                await rdzvs.pop(rest[0]).leave()
            elif cmd == "add":
                await start(tg, rest[0])
            elif cmd == "quit":
                break
        tg.cancel_scope.cancel()


def _leader_lease(rdzv: Any) -> int:
    state = rdzv._agent.state()
    return state.leader.lease if state.leader is not None else -1


# ------------------------------------------------------------------ coordinator


@dataclass
class Agent:
    """One agent process; its JSON lines arrive on ``lines`` (a reader thread)."""

    process: subprocess.Popen[str]
    lines: queue.Queue[dict[str, Any]] = field(default_factory=queue.Queue)

    def send(self, text: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(text + "\n")
        self.process.stdin.flush()


class Run:
    """Every agent process of one N, and what they reported."""

    def __init__(self, endpoint: str, n: int, procs: int, ttl: int, logs: Path) -> None:
        self.n, self.ttl = n, ttl
        self.run_id = f"scale-{n}-{os.getpid()}"
        self.agents: list[Agent] = []
        self.records: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self.endpoint, self.logs = endpoint, logs
        main = n - 1  # one participant lives in the victim process
        sizes = [main // procs + (1 if i < main % procs else 0) for i in range(procs)]
        offset = 0
        for size in sizes:
            self.agents.append(self._spawn(offset, size))
            offset += size
        self.victim_node = NODE.format(offset)
        self.victim: Agent | None = None

    def _spawn(self, offset: int, count: int) -> Agent:
        err = open(self.logs / f"agent-{self.n}-{offset}.log", "w")  # noqa: SIM115
        with err:
            process = subprocess.Popen(
                [sys.executable, __file__, "--agent", "--endpoint", self.endpoint,
                 "--run-id", self.run_id, "--total", str(self.n), "--offset", str(offset),
                 "--count", str(count), "--ttl", str(self.ttl),
                 *(["--verbose"] if VERBOSE else [])],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                cwd=REPO, start_new_session=True)
        agent = Agent(process)
        threading.Thread(target=self._read, args=(agent,), daemon=True).start()
        return agent

    def _read(self, agent: Agent) -> None:
        assert agent.process.stdout is not None
        for line in agent.process.stdout:
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                record["agent"] = id(agent)
                self.records.put(record)
                agent.lines.put(record)

    def wait(self, what: str, done: Any) -> list[dict[str, Any]]:
        """Collect records until ``done(records)`` is true; bounded by PHASE_TIMEOUT."""
        deadline = time.monotonic() + PHASE_TIMEOUT
        found: list[dict[str, Any]] = []
        while not done(found):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"N={self.n}: {what}: timed out ({len(found)} records)")
            try:
                record = self.records.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if any(a.process.poll() not in (None, -9) for a in self.all_agents()):
                    raise RuntimeError(f"N={self.n}: an agent process died") from None
                continue
            self.seen.append(record)
            found.append(record)
        return found

    def all_agents(self) -> list[Agent]:
        return self.agents + ([self.victim] if self.victim else [])

    def stats(self) -> tuple[dict[str, dict[str, int]], set[str]]:
        """Every live participant's counters, and which of them leads."""
        for agent in self.all_agents():
            if agent.process.poll() is None:
                agent.send("stats")
        live = [a for a in self.all_agents() if a.process.poll() is None]
        got = self.wait("stats", lambda rs: sum(r["ev"] == "stats" for r in rs) >= len(live))
        merged: dict[str, dict[str, int]] = {}
        leaders: set[str] = set()
        for record in (r for r in got if r["ev"] == "stats"):
            merged.update(record["stats"])
            leaders |= {n for n, is_leader in record["leader"].items() if is_leader}
        return merged, leaders

    def close(self) -> None:
        for agent in self.all_agents():
            with contextlib.suppress(OSError, ValueError):
                agent.send("quit")
        deadline = time.monotonic() + 10
        for agent in self.all_agents():
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.process.wait(max(deadline - time.monotonic(), 0.1))
            if agent.process.poll() is None:
                os.killpg(agent.process.pid, signal.SIGKILL)
                agent.process.wait()


def rounds(records: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    return [r for r in records if r["ev"] == "round" and r["round"] == n]


def delta(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]],
          leaders: set[str]) -> dict[str, float]:
    """Per-participant means over the non-leaders (and the leader's own) of each counter."""
    keys = ("requests", "rdzv_requests", "txn_conflicts", "failed_attempts", "watch_events",
            "watch_bytes")
    for stats in (*before.values(), *after.values()):  # rendezvous work: all but keepalives
        stats["rdzv_requests"] = stats["requests"] - stats.get("path:/v3/lease/keepalive", 0)
    nodes = [n for n in after if n in before]
    followers = [n for n in nodes if n not in leaders] or nodes
    out: dict[str, float] = {}
    for key in keys:
        values = [after[n][key] - before[n][key] for n in followers]
        out[key] = statistics.fmean(values) if values else 0.0
        out[f"{key}_max"] = max(values) if values else 0
        lead = [after[n][key] - before[n][key] for n in nodes if n in leaders]
        out[f"{key}_leader"] = max(lead) if lead else 0
    return out


def run_one(endpoint: str, n: int, procs: int, ttl: int, idle: float, logs: Path
            ) -> dict[str, Any]:
    log(f"N={n}: starting {procs} agent processes + 1 victim")
    run = Run(endpoint, n, procs, ttl, logs)
    out: dict[str, Any] = {"n": n}
    try:
        ready = run.wait("setup", lambda rs: sum(r["ev"] == "ready" for r in rs) >= procs)
        run.victim = run._spawn(n - 1, 1)  # last: the leader is never the victim
        ready += run.wait("victim", lambda rs: any(r["ev"] == "ready" for r in rs))
        out["setup_s"] = max(r["setup"] for r in ready)
        out["fds_per_participant"] = statistics.fmean(r["fds_per_participant"] for r in ready)
        s0, leaders = run.stats()
        out["leaders"] = sorted(leaders)

        # formation: everyone at once
        go = time.monotonic() + 0.5
        for agent in run.all_agents():
            agent.send(f"go {go}")
        got = run.wait("formation", lambda rs: len(rounds(rs, 0)) >= n)
        r0 = rounds(got, 0)
        last = max(r["t"] for r in r0)
        out["form_last_join_s"] = last - max(r["joined"] for r in r0)
        out["form_all_s"] = last - go
        log(f"N={n}: go {go:.3f}, last join {max(r['joined'] for r in r0):.3f}, "
            f"first round {min(r['t'] for r in r0):.3f}, last {last:.3f}")
        s1, leaders = run.stats()
        out["formation"] = delta(s0, s1, leaders)
        log(f"N={n}: formed in {out['form_all_s']:.3f}s")

        # loss: a node crash
        assert run.victim is not None
        killed = time.monotonic()
        os.killpg(run.victim.process.pid, signal.SIGKILL)
        got = run.wait("loss", lambda rs: len(rounds(rs, 1)) >= n - 1)
        notices = [r["t"] for r in got if r["ev"] == "notice" and r["round"] == 0]
        out["loss_noticed_raw_s"] = max(notices) - killed
        out["loss_noticed_s"] = max(notices) - killed - ttl
        out["loss_reformed_s"] = max(r["t"] for r in rounds(got, 1)) - killed - ttl
        s2, leaders = run.stats()
        out["loss"] = delta(s1, s2, leaders)
        log(f"N={n}: loss reformed {out['loss_reformed_s']:.3f}s after the TTL")

        # clean leave: a non-leader of the first agent process
        leaver = next(NODE.format(i) for i in range(n) if NODE.format(i) not in leaders)
        run.agents[0].send(f"leave {leaver}")
        got = run.wait("leave", lambda rs: len(rounds(rs, 2)) >= n - 2)
        asked = next(r["t"] for r in run.seen if r["ev"] == "leaving")
        notices = [r["t"] for r in got if r["ev"] == "notice" and r["round"] == 1]
        out["leave_noticed_s"] = max(notices) - asked
        out["leave_reformed_s"] = max(r["t"] for r in rounds(got, 2)) - asked
        s3, leaders = run.stats()
        out["leave"] = delta(s2, s3, leaders)

        # scale-up: one newcomer
        run.agents[0].send(f"add {NODE.format(n)}")
        got = run.wait("scale-up", lambda rs: len(rounds(rs, 3)) >= n - 1)
        joined = next(r["waited"] for r in rounds(got, 3) if r["node"] == NODE.format(n))
        notices = [r["t"] for r in got if r["ev"] == "notice" and r["round"] == 2]
        out["scale_noticed_s"] = max(notices) - joined
        out["scale_reformed_s"] = max(r["t"] for r in rounds(got, 3)) - joined
        s4, leaders = run.stats()
        out["scale_up"] = delta(s3, s4, leaders)

        # idle
        log(f"N={n}: idle for {idle:g}s")
        time.sleep(idle)
        s5, leaders = run.stats()
        idle_delta = delta(s4, s5, leaders)
        out["idle_per_min"] = {k: v * 60 / idle for k, v in idle_delta.items()}
    finally:
        run.close()
    return out


# ------------------------------------------------------------------ etcd and report


@contextlib.contextmanager
def etcd_server(root: Path) -> Iterator[str]:
    exe = shutil.which("etcd")
    if exe is None:
        raise SystemExit("etcd is not installed (apt-get install etcd-server)")
    client, peer = free_port(), free_port()
    url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    with open(root / "etcd.log", "wb") as out:
        process = subprocess.Popen(
            [exe, "--name", "scale", "--data-dir", str(root / "etcd"),
             "--listen-client-urls", url, "--advertise-client-urls", url,
             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
             "--initial-cluster", f"scale={peer_url}", "--heartbeat-interval", "10",
             "--election-timeout", "100", "--quota-backend-bytes", str(2 << 30)],
            stdout=out, stderr=out, start_new_session=True)
    try:
        deadline = time.monotonic() + 15
        while True:
            with contextlib.suppress(OSError, ValueError), \
                    urllib.request.urlopen(url + "/health", timeout=1) as resp:
                if json.load(resp).get("health") == "true":
                    break
            if time.monotonic() > deadline or process.poll() is not None:
                raise SystemExit("etcd did not become healthy")
            time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def table(results: list[dict[str, Any]], ttl: int, idle: float) -> str:
    cols = [str(r["n"]) for r in results]
    lines = ["| N participants | " + " | ".join(cols) + " |",
             "|---|" + "---:|" * len(cols)]

    def row(name: str, fmt: str, get: Any) -> None:
        lines.append(f"| {name} | " + " | ".join(fmt.format(get(r)) for r in results) + " |")

    row("formation: start -> complete (s)", "{:.3f}", lambda r: r["form_all_s"])
    row("formation: last join -> all have it (s)", "{:.3f}", lambda r: r["form_last_join_s"])
    row("loss: kill -> noticed by all (s)", "{:.3f}", lambda r: r["loss_noticed_raw_s"])
    row(f"loss: noticed by all - TTL {ttl} s (s)", "{:.3f}", lambda r: r["loss_noticed_s"])
    row(f"loss: all reformed - TTL {ttl} s (s)", "{:.3f}", lambda r: r["loss_reformed_s"])
    row("leave: noticed by all (s)", "{:.3f}", lambda r: r["leave_noticed_s"])
    row("leave: all reformed (s)", "{:.3f}", lambda r: r["leave_reformed_s"])
    row("scale-up: noticed by all (s)", "{:.3f}", lambda r: r["scale_noticed_s"])
    row("scale-up: all reformed (s)", "{:.3f}", lambda r: r["scale_reformed_s"])
    for phase in ("formation", "loss", "leave", "scale_up"):
        row(f"{phase}: rendezvous requests / participant (max; leader)", "{}",
            lambda r, p=phase: f"{r[p]['rdzv_requests']:.2f} ({r[p]['rdzv_requests_max']}; "
                               f"{r[p]['rdzv_requests_leader']})")
        row(f"{phase}: all requests incl. keepalives / participant", "{}",
            lambda r, p=phase: f"{r[p]['requests']:.1f}")
        row(f"{phase}: txn conflicts / participant (leader)", "{}",
            lambda r, p=phase: f"{r[p]['txn_conflicts']:.2f} ({r[p]['txn_conflicts_leader']})")
        row(f"{phase}: watch events / participant (leader)", "{}",
            lambda r, p=phase: f"{r[p]['watch_events']:.1f} ({r[p]['watch_events_leader']})")
        row(f"{phase}: watch value bytes / participant (leader)", "{}",
            lambda r, p=phase: f"{r[p]['watch_bytes']:.0f} ({r[p]['watch_bytes_leader']})")
    row("all phases: failed attempts (retries) / participant", "{:.2f}",
        lambda r: sum(r[p]["failed_attempts"] for p in ("formation", "loss", "leave",
                                                         "scale_up")))
    row(f"idle: requests / participant / min (TTL {ttl} s, {idle:g} s window)", "{:.1f}",
        lambda r: r["idle_per_min"]["requests"])
    row("idle: watch events / participant / min", "{:.2f}",
        lambda r: r["idle_per_min"]["watch_events"])
    row("setup: lease + watch + campaign, slowest process (s)", "{:.2f}",
        lambda r: r["setup_s"])
    row("open fds / participant (agent process)", "{:.1f}", lambda r: r["fds_per_participant"])
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agent", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--run-id", help=argparse.SUPPRESS)
    parser.add_argument("--total", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--offset", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--ttl", type=int, default=5, help=argparse.SUPPRESS)
    parser.add_argument("--verbose", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="16,64,256,1024")
    parser.add_argument("--procs", type=int, default=4, help="agent processes per N")
    parser.add_argument("--lease-ttl", type=int, default=10, help="s (the default's)")
    parser.add_argument("--idle", type=float, default=30.0, help="idle window (s)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the logs (printed dir)")
    args = parser.parse_args()
    if args.agent:
        import anyio

        anyio.run(agent_main, args)
        return
    soft, hard = raise_nofile()
    log(f"RLIMIT_NOFILE soft {soft} hard {hard}")
    results = []
    tmp = tempfile.mkdtemp(prefix="rdzv-scale-")
    log(f"logs in {tmp}")
    with contextlib.ExitStack() as stack:
        if not args.keep:
            stack.callback(shutil.rmtree, tmp, True)
        endpoint = stack.enter_context(etcd_server(Path(tmp)))
        for n in (int(x) for x in args.sizes.split(",")):
            results.append(run_one(endpoint, n, min(args.procs, max(n - 1, 1)),
                                   args.lease_ttl, args.idle, Path(tmp)))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(table(results, args.lease_ttl, args.idle))


if __name__ == "__main__":
    main()
