"""Network-fault scenarios: an etcd-backed job whose nodes and etcd members live in their
own network namespaces (``tests.support.netlab``), faults made on the bridge, figures read from
each node's event log (monotonic times, one clock for every namespace of the machine).

Shared by ``tests/e2e/test_network_faults.py`` (short cases, in CI) and
``benchmarks/netfaults.py`` (long cases, by explicit command). Every scenario returns a
dict of figures; the caller asserts or tabulates them. ``code`` is the source tree the
supervisors run from (``PYTHONPATH``), so the same scenario measures another checkout
(the "before" column of docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support import deps
from tests.support.eventlog import read_events
from tests.support.netlab import Host, NetLab, delay_unavailable, round_trip, unavailable
from tests.support.paths import FAKE_WORKER, REPO

CLIENT_PORT, PEER_PORT, HEALTH_PORT = 2379, 2380, 8080  # inside the lab's namespaces only
POLL = 0.05  # seconds between two reads of the event logs while waiting on them


ETCDCTL = "apt-get install etcd-client (.ci/run does)"


def need_lab(*, etcdctl: bool = False, delay: bool = False) -> None:
    """Skip with the reason (fail under ELASTIC_SUPERVISOR_REQUIRE_DEPS=1) where network
    namespaces, etcd (or, when asked, etcdctl: ``Job.etcd_get``; the lab's delay) are not
    available."""
    reason = unavailable() or (delay_unavailable() if delay else None)
    if reason is not None:
        deps.missing(reason)
    deps.need_binary("etcd")
    if etcdctl:
        deps.need_binary("etcdctl", ETCDCTL)


class ScenarioError(AssertionError):
    """A scenario did not reach a state it waits for."""


def wait_for(what: str, check: Callable[[], Any], timeout: float) -> Any:
    """``check()``'s first truthy value, reading files until ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise ScenarioError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(POLL)


_GET = ("import sys, urllib.request\n"
        "try:\n"
        "    body = urllib.request.urlopen(sys.argv[1], timeout=1).read()\n"
        "except Exception:\n    sys.exit(1)\n"
        "sys.stdout.buffer.write(body)\n")


def http_get(host: Host, url: str) -> bytes | None:
    """``url``'s body fetched from inside ``host``'s namespace (the lab's addresses are
    reachable only there), None if it does not answer in 1 s."""
    done = subprocess.run(["ip", "netns", "exec", host.ns, sys.executable, "-c", _GET, url],
                          capture_output=True)
    return done.stdout if done.returncode == 0 else None


# etcd's heartbeat interval and election timeout in the lab, ms (its defaults: 100, 1000);
# benchmarks/netfaults.py --election-timeout sets them (heartbeat a tenth of it)
ETCD_TIMING_MS = [50, 500]


@dataclass
class Etcd:
    """One etcd member in its namespace."""

    host: Host
    name: str
    data: Path
    cluster: str
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host.addr}:{CLIENT_PORT}"

    def command(self, state: str) -> list[str]:
        peer = f"http://{self.host.addr}:{PEER_PORT}"
        return ["etcd", "--name", self.name, "--data-dir", str(self.data),
                "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", self.cluster, "--initial-cluster-state", state,
                "--heartbeat-interval", str(ETCD_TIMING_MS[0]),
                "--election-timeout", str(ETCD_TIMING_MS[1])]


@dataclass
class Node:
    """One supervisor in its namespace."""

    host: Host
    log_dir: Path
    run_id: str
    proc: subprocess.Popen[bytes]

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return read_events(self.log_dir / self.run_id / "events.jsonl", kind)

    def first(self, kind: str, after: float, where: Callable[[dict[str, Any]], bool]
              = lambda e: True) -> float | None:
        times = [float(e["mono"]) for e in self.events(kind)
                 if float(e["mono"]) > after and where(e)]
        return min(times) if times else None

    def group_started(self, after: float, world: int | None = None) -> float | None:
        """The first group started after ``after`` (in a round of ``world`` nodes)."""
        return self.first("group_started", after,
                          lambda e: world is None or self._world_of(e) == world)

    def _world_of(self, started: dict[str, Any]) -> int:
        rounds = [e for e in self.events("rendezvous") if float(e["mono"]) <= started["mono"]]
        return int(rounds[-1].get("group_world_size", 0)) if rounds else 0

    def pids(self) -> set[int]:
        started = self.events("group_started")
        return {int(p) for p in started[-1]["pids"].values()} if started else set()

    def status(self) -> dict[str, Any] | None:
        """Its ``/status`` (None if it does not answer)."""
        body = http_get(self.host, f"http://{self.host.addr}:{HEALTH_PORT}/status")
        return None if body is None else dict(json.loads(body))


@dataclass
class Job:
    """The lab, the etcd members and the nodes of one scenario."""

    lab: NetLab
    root: Path
    code: Path
    ttl: int
    members: list[Etcd] = field(default_factory=list)
    nodes: dict[str, Node] = field(default_factory=dict)
    run_id: str = field(default_factory=lambda: f"net-{uuid.uuid4().hex[:8]}")

    def start_etcd(self, count: int = 1) -> list[Etcd]:
        hosts = [self.lab.host(f"e{i}") for i in range(count)]
        cluster = ",".join(f"e{i}=http://{h.addr}:{PEER_PORT}" for i, h in enumerate(hosts))
        self.members = [Etcd(h, f"e{i}", self.root / f"etcd{i}", cluster)
                        for i, h in enumerate(hosts)]
        for member in self.members:
            self._run_etcd(member, "new")
        for member in self.members:
            self.wait_etcd_healthy(member)
        return self.members

    def _run_etcd(self, member: Etcd, state: str) -> None:
        log = open(self.root / f"{member.name}.log", "ab")  # noqa: SIM115 -- the child owns it
        member.proc = self.lab.spawn(member.host, member.command(state), stdout=log,
                                     stderr=subprocess.STDOUT)
        log.close()

    def wait_etcd_healthy(self, member: Etcd, timeout: float = 20) -> None:
        url = f"{member.endpoint}/health"
        wait_for(f"etcd {member.name} healthy",
                 lambda: b"true" in (http_get(member.host, url) or b""), timeout)

    def restart_etcd(self, member: Etcd) -> None:
        """SIGKILL the member and start it again on its data (its clients' connections die
        on etcd's side only)."""
        assert member.proc is not None
        member.proc.kill()
        member.proc.wait()
        self._run_etcd(member, "existing")

    def start_node(self, label: str, *, nnodes: str = "2:3", conf: str = "",
                   flags: Sequence[str] = (), host: Host | None = None,
                   worker: Sequence[str] = ("--hang",)) -> Node:
        """A supervisor in a new namespace ``label``, or in ``host``'s again (a restart on
        the same node: the same log dir and stderr file); ``worker``: the fake worker's
        flags."""
        host = host or self.lab.host(label)
        log_dir = self.root / label
        endpoints = ",".join(m.endpoint for m in self.members)
        rdzv_conf = f"lease_ttl={self.ttl},last_call_timeout=1,join_timeout=300"
        argv = [sys.executable, "-m", "supervisor", "run", "--rdzv-backend", "etcd",
                "--rdzv-endpoint", endpoints, "--rdzv-id", self.run_id, "--nnodes", nnodes,
                "--nproc-per-node", "1", "--rdzv-conf", rdzv_conf + (f",{conf}" if conf else ""),
                "--local-addr", host.addr, "--health-host", host.addr,
                "--health-port", str(HEALTH_PORT), "--log-dir", str(log_dir),
                "--shutdown-timeout", "5", *flags, FAKE_WORKER, *worker]
        env = {**os.environ, "PYTHONPATH": str(self.code)}
        err = open(self.root / f"{label}.stderr", "ab")  # noqa: SIM115 -- the child owns it
        proc = self.lab.spawn(host, argv, cwd=str(self.code), env=env,
                              stdout=subprocess.DEVNULL, stderr=err)
        err.close()
        node = Node(host, log_dir, self.run_id, proc)
        self.nodes[label] = node
        return node

    def wait_group(self, nodes: Sequence[Node], world: int, after: float = 0.0,
                   timeout: float = 60) -> float:
        """Until every node runs a group of ``world`` nodes started after ``after``; the
        latest start."""
        def started() -> float | None:
            times = [n.group_started(after, world) for n in nodes]
            return max(times) if all(t is not None for t in times) else None  # type: ignore[type-var]
        return float(wait_for(f"a {world}-node group on {[n.host.label for n in nodes]}",
                              started, timeout))

    def etcd_get(self, key: str) -> Any:
        """The JSON value of the job's ``key`` (under its prefix), None if absent: read by
        etcdctl inside the first member's namespace (etcd is reachable only there)."""
        member = self.members[0]
        done = subprocess.run(["ip", "netns", "exec", member.host.ns, "etcdctl",
                               "--endpoints", member.endpoint, "get", "--print-value-only",
                               f"/elastic-supervisor/{self.run_id}/{key}"],
                              capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise ScenarioError(f"etcdctl get {key}: {done.stderr.strip()}")
        return json.loads(done.stdout) if done.stdout.strip() else None

    def _etcdctl(self, endpoints: Sequence[Etcd], *args: str) -> str:
        member = self.members[0]
        done = subprocess.run(["ip", "netns", "exec", member.host.ns, "etcdctl",
                               "--endpoints", ",".join(m.endpoint for m in endpoints), *args],
                              capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise ScenarioError(f"etcdctl {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def raft_ids(self) -> tuple[list[int], int]:
        """Each member's raft id (in ``members`` order) and the raft leader's id."""
        rows = json.loads(self._etcdctl(self.members, "endpoint", "status", "-w", "json"))
        ids = [int(row["Status"]["header"]["member_id"]) for row in rows]
        return ids, int(rows[0]["Status"]["leader"])

    def make_raft_leader(self, member: Etcd) -> None:
        """Move etcd's raft leadership to ``member`` (etcdctl move-leader), unless it
        leads already."""
        ids, leader = self.raft_ids()
        target = ids[self.members.index(member)]
        if leader != target:
            current = self.members[ids.index(leader)]
            self._etcdctl([current], "move-leader", f"{target:x}")
        wait_for(f"{member.name} leading", lambda: self.raft_ids()[1] == target, 20)

    def cut_from_etcd(self, node: Node) -> None:
        for member in self.members:
            self.lab.cut(node.host, member.host)

    def heal_from_etcd(self, node: Node) -> None:
        for member in self.members:
            self.lab.heal(node.host, member.host)

    def watch_election(self, members: Sequence[Etcd]) -> subprocess.Popen[bytes]:
        """A poller (in the first of ``members``' namespace) that prints the monotonic time
        at which one of ``members`` first names a raft leader other than the current one
        (asked back to back, a few milliseconds each; ``_elected_at`` reads it)."""
        _, leader = self.raft_ids()
        urls = [m.endpoint + "/v3/maintenance/status" for m in members]
        return self.lab.spawn(members[0].host, [sys.executable, "-c", _ELECTION_POLLER,
                                                str(leader), *urls], stdout=subprocess.PIPE)

    def isolate(self, member: Etcd) -> None:
        for host in self.lab.hosts.values():
            if host is not member.host and not host.label.startswith("sw"):
                self.lab.cut(member.host, host)

    def stop(self) -> None:
        for node in self.nodes.values():
            if node.proc.poll() is None:
                node.proc.send_signal(signal.SIGTERM)
        for node in self.nodes.values():
            try:
                node.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                node.proc.kill()


@contextmanager
def job(*, ttl: int, code: Path = REPO, keep: Path | None = None) -> Iterator[Job]:
    """A lab and a job on it; everything is removed on exit, also on failure."""
    with tempfile.TemporaryDirectory(prefix="netjob-") as tmp, NetLab() as lab:
        root = keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        made = Job(lab, root, code, ttl)
        try:
            yield made
        finally:
            made.stop()


# ------------------------------------------------------------------ scenarios


def cut_node_from_etcd(*, ttl: int, cut: float, restart_etcd: bool = False,
                       code: Path = REPO, keep: Path | None = None) -> dict[str, Any]:
    """Nodes A, B, C and one etcd; C is cut from etcd (nft drops, no error at either end)
    for ``cut`` seconds (etcd SIGKILLed and restarted in the middle with
    ``restart_etcd``), then healed. Figures: when A and B re-formed without C, when C's old
    group stopped, how long two groups ran at once, and when C ran again after the heal."""
    with job(ttl=ttl, code=code, keep=keep) as j:
        j.start_etcd(1)
        a, b, c = (j.start_node(x) for x in "abc")
        j.wait_group([a, b, c], 3)
        old_c = c.pids()
        cut_at = time.monotonic()
        j.cut_from_etcd(c)
        if restart_etcd:
            wait_for("half the cut", lambda: time.monotonic() - cut_at >= cut / 2, cut)
            j.restart_etcd(j.members[0])
            j.wait_etcd_healthy(j.members[0])
        wait_for("the end of the cut", lambda: time.monotonic() - cut_at >= cut, cut + 30)
        reformed = [n.group_started(cut_at, 2) for n in (a, b)]
        c_stopped = c.first("group_stopped", cut_at)
        healed_at = time.monotonic()
        j.heal_from_etcd(c)
        rejoined = j.wait_group([a, b, c], 3, after=healed_at, timeout=max(60, 6 * ttl))
        reform = max(t for t in reformed if t is not None) if all(reformed) else None
        c_stopped = c_stopped or c.first("group_stopped", cut_at)
        overlap_end = c_stopped if c_stopped is not None else rejoined
        return {
            "cut": cut, "ttl": ttl, "etcd_restarted": restart_etcd,
            "survivors_reformed_after_cut": _rel(reform, cut_at),
            "c_stopped_after_cut": _rel(c_stopped, cut_at),
            "two_groups_for": None if reform is None else max(0.0, overlap_end - reform),
            "rejoined_after_heal": rejoined - healed_at,
            "c_pids_changed": c.pids() != old_c,
        }


def isolated_member(*, ttl: int, settle: float, code: Path = REPO,
                    keep: Path | None = None) -> dict[str, Any]:
    """A 3-member etcd (each member in its own namespace) and nodes A, B, C whose first
    endpoint is member e0. e0 is isolated at the bridge; after ``settle`` seconds node C
    leaves (SIGTERM), then B is SIGKILLed, then node D arrives. Figures: how long each took
    to be seen by the others."""
    with job(ttl=ttl, code=code, keep=keep) as j:
        j.start_etcd(3)
        a, b, c = (j.start_node(x) for x in "abc")
        j.wait_group([a, b, c], 3)
        isolated_at = time.monotonic()
        e0 = j.members[0].endpoint
        j.isolate(j.members[0])
        wait_for("the settle time", lambda: time.monotonic() - isolated_at >= settle,
                 settle + 5)
        moved = {n.host.label: _watch_off(n, e0, isolated_at) for n in (a, b, c)}
        watches = {n.host.label: _watch_states(n, isolated_at) for n in (a, b, c)}
        left_at = time.monotonic()
        c.proc.send_signal(signal.SIGTERM)
        leave_seen = [wait_for("the leave seen", lambda n=n: n.first("membership_changed",
                                                                    left_at), 60)
                      for n in (a, b)]
        j.wait_group([a, b], 2, after=left_at)
        killed_at = time.monotonic()
        b.proc.kill()
        loss_seen = wait_for("the loss seen", lambda: a.first("membership_changed", killed_at),
                             max(60, 6 * ttl))
        joined_at = time.monotonic()
        d = j.start_node("d")
        j.wait_group([a, d], 2, after=joined_at, timeout=60)
        wait_ready = d.first("rendezvous", joined_at)
        return {
            "ttl": ttl, "settle": settle,
            "isolated": e0,
            # per node: seconds after the isolation since when no stream of its watch has
            # been on e0 (0: none was at the isolation), None if one still was at the end
            "watches_moved_after_isolation": {k: _rel(t, isolated_at) for k, t in moved.items()},
            "watch_states": watches,
            "leave_seen_after": max(leave_seen) - left_at,
            "loss_seen_after": loss_seen - killed_at,
            "scale_up_round_after": _rel(wait_ready, joined_at),
        }


_ELECTION_POLLER = r'''
import json, sys, time, urllib.request
old, urls = sys.argv[1], sys.argv[2:]
while True:
    for url in urls:
        try:
            request = urllib.request.Request(url, data=b"{}", method="POST")
            with urllib.request.urlopen(request, timeout=0.2) as resp:
                leader = str(json.load(resp).get("leader", "0"))
        except OSError:
            continue
        if leader not in ("0", old):
            print(time.monotonic(), flush=True)
            sys.exit(0)
'''


def _elected_at(poller: subprocess.Popen[bytes] | None) -> float | None:
    """What a ``watch_election`` poller printed (None: none, or it saw no election)."""
    if poller is None:
        return None
    try:
        out, _ = poller.communicate(timeout=30)
        return float(out.split()[0])
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        poller.kill()
        return None


def leave_after_isolation(*, ttl: int, raft_leader: bool = False, kill: bool = False,
                          code: Path = REPO, keep: Path | None = None) -> dict[str, Any]:
    """A 3-member etcd and nodes A, B, C whose first endpoint is member e0; e0 is
    isolated at the bridge and node C leaves (SIGTERM) right after, before any watch
    could notice that e0 went quiet. e0 is a raft follower (or, with ``raft_leader``, the
    raft leader: then nothing commits until e1 and e2 elect a new leader, after the
    election timeout, ``ETCD_TIMING_MS``: 500 ms unless said otherwise). Figures: when A
    and B saw the leave, and when each node's watch left e0 (a stream closed there), both
    after the isolation. With ``kill``, e0 is SIGKILLed instead of isolated (its clients'
    connections close at once): the same election with no blind member, for comparison."""
    with job(ttl=ttl, code=code, keep=keep) as j:
        j.start_etcd(3)
        a, b, c = (j.start_node(x) for x in "abc")
        j.wait_group([a, b, c], 3)
        e0 = j.members[0].endpoint
        j.make_raft_leader(j.members[0] if raft_leader else j.members[1])
        elected = j.watch_election(j.members[1:]) if raft_leader else None
        isolated_at = time.monotonic()
        if kill:
            assert j.members[0].proc is not None
            j.members[0].proc.kill()
        else:
            j.isolate(j.members[0])
        c.proc.send_signal(signal.SIGTERM)
        left_at = time.monotonic()

        def saw_leave(n: Node) -> Callable[[], float | None]:
            return lambda: n.first("membership_changed", left_at)
        seen = [wait_for("the leave seen", saw_leave(n), 60) for n in (a, b)]

        def left_e0(n: Node) -> float | None:
            return n.first("etcd_watch", isolated_at,
                           lambda e: bool(e.get("live"))
                           and e0 not in (e.get("endpoints") or [e.get("endpoint")]))
        try:  # not needed for the leave: recorded to show it came first
            moved = wait_for("the watches leaving e0",
                             lambda: all(left_e0(n) for n in (a, b)) and
                             [left_e0(n) for n in (a, b)], 10 * ttl)
        except ScenarioError:
            moved = [left_e0(n) for n in (a, b)]
        election = _elected_at(elected)
        # through etcd, or told by C directly (its leave notice, while etcd commits nothing)
        told = [n.first("membership_changed", left_at,
                        lambda e: "told this node directly" in str(e.get("reason")))
                is not None for n in (a, b)]
        return {
            "ttl": ttl, "e0_raft_leader": raft_leader, "e0": "killed" if kill else "isolated",
            "told_directly": told,
            "left_after_isolation": left_at - isolated_at,
            # with e0 the leader: when e1 or e2 first named a new one, after the isolation
            "new_leader_after_isolation": _rel(election, isolated_at),
            "leave_seen_after_the_election": None if election is None
            else max(seen) - election,
            "leave_seen_after": max(seen) - left_at,
            "leave_seen_by": [t - left_at for t in seen],
            "watches_left_e0_after_isolation": [_rel(t, isolated_at) for t in moved],
            "seen_before_the_watches_moved": all(m is None or s < m
                                                 for s, m in zip(seen, moved, strict=True)),
        }


def etcd_down_for_everyone(*, ttl: int, outage: float, code: Path = REPO,
                           keep: Path | None = None) -> dict[str, Any]:
    """Nodes A, B, C and one etcd whose link goes down for ``outage`` seconds: every node
    loses etcd, the peers answer and say so. Figures: worker pids kept, restarts."""
    with job(ttl=ttl, code=code, keep=keep) as j:
        j.start_etcd(1)
        nodes = [j.start_node(x) for x in "abc"]
        j.wait_group(nodes, 3)
        before = [n.pids() for n in nodes]
        down_at = time.monotonic()
        j.lab.link_down(j.members[0].host)
        wait_for("the end of the outage", lambda: time.monotonic() - down_at >= outage,
                 outage + 5)
        j.lab.link_up(j.members[0].host)
        up_at = time.monotonic()
        wait_for("etcd reachable on every node",
                 lambda: all(n.first("etcd_reachable", up_at - 0.5) for n in nodes), 30)
        settle = time.monotonic()
        wait_for("one TTL after", lambda: time.monotonic() - settle >= ttl + 1, ttl + 5)
        return {
            "ttl": ttl, "outage": outage,
            "same_pids": [n.pids() for n in nodes] == before,
            "group_stops": sum(1 for n in nodes for _ in n.events("group_stopped")),
            "cut_off_verdicts": sum(1 for n in nodes for _ in n.events("etcd_cut_off")),
        }


def lossy_links(*, ttl: int, percent: int, seconds: float, rtt_ms: float = 0,
                code: Path = REPO, keep: Path | None = None) -> dict[str, Any]:
    """Nodes A, B, C and one etcd; ``percent`` % of the frames between every node and etcd
    are dropped at random (nftables ``numgen``) and, with ``rtt_ms``, every packet between
    them is held half of it each way (the lab's delayer; no netem here), from before each
    supervisor starts. Figures: how long the job took to form (until all three ran a
    3-node group, from the supervisors' spawn and from the first one's
    ``supervisor_started``; a 2-node round first, restarted when the third node came, is
    part of forming), and the spurious stops (after forming), the outages and watch
    moves."""
    with job(ttl=ttl, code=code, keep=keep) as j:
        j.start_etcd(1)
        etcd = j.members[0].host
        hosts = [j.lab.host(label) for label in "abc"]
        for host in hosts:
            if percent:
                j.lab.lossy(host, etcd, percent)
            if rtt_ms:
                j.lab.delay(host, etcd, rtt_ms / 2)
                j.lab.delay(etcd, host, rtt_ms / 2)
        started = time.monotonic()
        nodes = [j.start_node(host.label, host=host) for host in hosts]
        formed = j.wait_group(nodes, 3, timeout=120)
        before = [n.pids() for n in nodes]
        wait_for("the run", lambda: time.monotonic() - formed >= seconds, seconds + 5)
        # the delay was there: connects to etcd's client port (a loss makes one longer)
        probes = [round_trip(hosts[0], etcd, CLIENT_PORT) for _ in range(3)]
        return {
            "ttl": ttl, "loss_percent": percent, "rtt_ms": rtt_ms, "seconds": seconds,
            "probe_rtt_min": min((p for p in probes if p is not None), default=None),
            "formed_after": formed - started,
            # the same without the interpreters' start (slow on a loaded machine)
            "formed_after_first_supervisor_up": formed - min(
                float(n.events("supervisor_started")[0]["mono"]) for n in nodes),
            "same_pids": [n.pids() for n in nodes] == before,
            "group_stops": sum(1 for n in nodes for e in n.events("group_stopped")
                               if float(e["mono"]) > formed),
            "watch_moves": sum(1 for n in nodes for e in n.events("etcd_watch")
                               if not e.get("live")),
            "outages": sum(1 for n in nodes for _ in n.events("etcd_unreachable")),
        }


def _watch_off(node: Node, member: str, since: float) -> float | None:
    """Since when ``node``'s control watch has been live with no stream on ``member``, as
    its events tell it now (``since`` at the earliest); None if a stream is still there,
    or none is open. A watch whose streams were both elsewhere already (moved by a slow
    request under load) has nothing to report after ``since``, and one that went back to
    ``member`` for a while counts from when it last left it."""
    off_since: float | None = None
    for e in node.events("etcd_watch"):
        if not (e.get("live") and member not in (e.get("endpoints") or [])):
            off_since = None
        elif off_since is None:
            off_since = max(float(e["mono"]), since)
    return off_since


def _watch_states(node: Node, since: float) -> list[tuple[float, bool, list[str]]]:
    """``node``'s watch as its events told it: the last one before ``since`` and each
    after it, as (seconds after ``since``, live, the members its streams were on)."""
    events = node.events("etcd_watch")
    before = [e for e in events if float(e["mono"]) <= since][-1:]
    after = [e for e in events if float(e["mono"]) > since]
    return [(round(float(e["mono"]) - since, 3), bool(e.get("live")),
             list(e.get("endpoints") or [])) for e in before + after]


def _rel(t: float | None, since: float) -> float | None:
    return None if t is None else t - since
