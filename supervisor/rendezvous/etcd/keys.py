"""The etcd rendezvous' keys, a read-only view of them, and the leader's pure decisions.

Keys live under ``/elastic-supervisor/<run_id>/`` as JSON values. Control keys, which every
agent follows by one narrow watch, are under ``ctl/``; per-node keys, which only the leader
follows, are under ``nodes/``::

    ctl/round                 {"round": N, "reason"}  the current round (absent: 0), and why
                                                      it was opened ("" after a restart)
    ctl/leader                lease-bound {"node"}    the agent that closes rounds
    ctl/result/N              {"nodes": [...], "sizes"} round N is complete: member ids in
                                                      group-rank order, local world sizes
                                                      (one number when all are equal)
    ctl/master/N              {"addr", "port"}        published by group rank 0 of round N
    ctl/restarts              {"count": K}            job-wide failure restarts
    ctl/closed                {"ok", "reason"}        the job is over for everyone
    ctl/cause/N               {"node", ...}           round N's root cause (node_records)
    health/<node>             {"failures", ...}       a node's failure record (node_records)
    nodes/N/join/<node>       lease-bound             joined round N (address, local world size)
    nodes/N/wait/<node>       lease-bound             arrived after round N completed; wants in
    nodes/N/done/<node>       not lease-bound         finished its workers (exit barrier)

``decide`` is the leader's whole policy as a pure function of that state.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from supervisor.core.jobstep import JobStep
from supervisor.rendezvous.etcd.node_records import cause_key, lost_reason
from supervisor.rendezvous.etcd.wire.client import JsonDict, KeyValue, compare, delete_op, put_op
from supervisor.rendezvous.etcd.wire.decode import (
    MAX_TEXT,
    Closed,
    Join,
    Master,
    Restarts,
    Result,
    Round,
    Shape,
    bounded,
    count_ignored,
    decode,
    node_part_ok,
    shown,
)
from supervisor.rendezvous.etcd.wire.jobstep import result_fields

S = TypeVar("S", bound=msgspec.Struct)

ROOT = "/elastic-supervisor"


class Keys:
    """The key names of one job."""

    def __init__(self, run_id: str) -> None:
        self.prefix = f"{ROOT}/{run_id}/"
        self.ctl = self.prefix + "ctl/"
        self.nodes = self.prefix + "nodes/"
        self.round = self.ctl + "round"
        self.leader = self.ctl + "leader"
        self.restarts = self.ctl + "restarts"
        self.closed = self.ctl + "closed"

    def result(self, n: int) -> str:
        return f"{self.ctl}result/{n}"

    def master(self, n: int) -> str:
        return f"{self.ctl}master/{n}"

    def cause(self, n: int) -> str:
        """``ctl/cause/N``: round N's root cause (``node_records``)."""
        return cause_key(self.prefix, n)

    def node(self, n: int, kind: str, node: str = "") -> str:
        """``nodes/n/kind/node``; with ``node`` "" the prefix of every node's key."""
        return f"{self.nodes}{n}/{kind}/{node}"


@dataclass(frozen=True)
class Member:
    node: str
    addr: str  # in join keys; a result leaves it "" (rank 0 publishes the master itself)
    local_world_size: int


def result_value(members: list[dict[str, Any]]) -> str:
    """The compact ``ctl/result/N`` value: every agent receives it, so its size is the
    round's per-agent O(N) cost in bytes (ids and sizes only, ~10-40 bytes a member)."""
    ordered = sorted(members, key=lambda m: str(m["node"]))
    sizes = [int(m["local_world_size"]) for m in ordered]
    same = len(set(sizes)) == 1
    return json.dumps({"nodes": [str(m["node"]) for m in ordered],
                       "sizes": sizes[0] if same else sizes,
                       **result_fields([(size, m.get("snap")) for size, m in zip(
                           sizes, ordered, strict=True)])}, separators=(",", ":"))


class State:
    """The job's keys as one agent last saw them (a read-only view of a ``PrefixView``'s
    ``kvs``: an agent's control view holds only ``ctl/``, the leader's holds every key).

    Every value is read through ``decode``: a bad ``ctl/`` value raises ``BadValue`` (a
    ``RendezvousError`` naming the key), a bad per-node key is skipped and counted."""

    def __init__(self, keys: Keys, kvs: Mapping[str, KeyValue]) -> None:
        self.keys = keys
        self._kvs = kvs
        self._index: dict[tuple[int, str], dict[str, KeyValue]] | None = None
        self._decoded: dict[str, object] = {}

    def kv(self, key: str) -> KeyValue | None:
        return self._kvs.get(key)

    @property
    def kvs(self) -> Mapping[str, KeyValue]:
        return self._kvs

    def _value(self, kind: str, key: str, expect: type[S]) -> S | None:
        """The decoded value of ``key`` (None: absent, or ignored); once per state: a
        result can be large."""
        if key not in self._decoded:
            kv = self._kvs.get(key)
            self._decoded[key] = None if kv is None else decode(kind, key, kv.value, expect)
        value = self._decoded[key]
        assert value is None or isinstance(value, expect)
        return value

    @property
    def round(self) -> int:
        data = self._value("ctl/round", self.keys.round, Round)
        return data.round if data else 0

    @property
    def round_reason(self) -> str:
        data = self._value("ctl/round", self.keys.round, Round)
        return shown(data.reason, MAX_TEXT) if data else ""

    @property
    def round_mod(self) -> int:
        kv = self.kv(self.keys.round)
        return kv.mod_revision if kv else 0

    @property
    def closed(self) -> Closed | None:
        """The job's end (its reason escaped: it goes into log lines and messages)."""
        data = self._value("ctl/closed", self.keys.closed, Closed)
        return msgspec.structs.replace(data, reason=shown(data.reason, MAX_TEXT)) \
            if data else None

    @property
    def shape(self) -> Shape | None:
        """The job's recorded shape (``sameid``); None if absent or unreadable."""
        return self._value("ctl/shape", self.keys.ctl + "shape", Shape)

    @property
    def restarts(self) -> Restarts | None:
        return self._value("ctl/restarts", self.keys.restarts, Restarts)

    @property
    def leader(self) -> KeyValue | None:
        return self.kv(self.keys.leader)  # only its lease is read

    def members(self, n: int) -> list[Member] | None:
        data = self._value("ctl/result", self.keys.result(n), Result)
        if data is None:
            return None
        return [Member(node, "", size)
                for node, size in zip(data.nodes, data.size_list(), strict=True)]

    def job_step(self, n: int) -> JobStep | None:
        """The snapshot step round ``n``'s result carries (``etcd.wire.jobstep``)."""
        data = self._value("ctl/result", self.keys.result(n), Result)
        return data.snap.job_step() if data is not None and data.snap is not None else None

    def master(self, n: int) -> tuple[str, int] | None:
        data = self._value("ctl/master", self.keys.master(n), Master)
        return (data.addr, data.port) if data else None

    def joins(self, n: int) -> dict[str, Join]:
        """Node id -> its join value in round ``n`` (join keys only: decoded)."""
        return {node: self._join(kv) for node, kv in self.nodes(n, "join").items()}

    def _join(self, kv: KeyValue) -> Join:
        value = self._decoded[kv.key]
        assert isinstance(value, Join)
        return value

    def nodes(self, n: int, kind: str) -> dict[str, KeyValue]:
        """Node id -> key of ``nodes/n/<kind>/`` (one pass over the keys per state). A key
        whose node id or (join) value is bad is skipped and counted."""
        if self._index is None:
            self._index = {}
            for key, kv in self._kvs.items():
                if key.startswith(self.keys.nodes):
                    self._add_node_key(key, kv)
        return self._index.get((n, kind), {})

    def _add_node_key(self, key: str, kv: KeyValue) -> None:
        assert self._index is not None
        parts = key[len(self.keys.nodes):].split("/", 2)
        if len(parts) != 3 or not (parts[0].isascii() and parts[0].isdigit()):
            return  # not a key of this protocol
        if not node_part_ok(parts[2]):
            count_ignored("nodes/" + parts[1], key, "not a node id", kv.mod_revision)
            return
        if parts[1] == "join":
            join = decode("nodes/join", key, kv.value, Join)
            if join is None:
                return
            if join.node != parts[2]:
                count_ignored("nodes/join", key, "names another node", kv.mod_revision)
                return
            self._decoded[key] = join
        self._index.setdefault((int(parts[0]), parts[1]), {})[parts[2]] = kv


# the leader's decisions


@dataclass(frozen=True)
class Wait:
    """Nothing to do until the state changes or ``until`` (monotonic) passes."""

    until: float = math.inf


@dataclass(frozen=True)
class Close:
    """Close round ``n`` with these join keys (at most ``max_nodes``: the previous round's
    members first, then the earliest joiners)."""

    n: int
    chosen: tuple[KeyValue, ...]


@dataclass(frozen=True)
class Advance:
    """Open round ``n + 1`` because of ``reason``."""

    n: int
    reason: str


@dataclass(frozen=True)
class Succeed:
    """Every member of the round finished: close the job as succeeded."""


Decision = Wait | Close | Advance | Succeed


@dataclass(frozen=True)
class Policy:
    min_nodes: int
    max_nodes: int
    last_call_timeout: float


def decide(state: State, policy: Policy, now: float, *, min_since: float | None,
           grace_until: float) -> Decision:
    """The leader's next step. ``min_since``: when round ``state.round`` first had
    ``min_nodes`` joiners (None: not yet). ``grace_until``: until then a member whose key
    vanished is not yet lost (etcd just came back: its agent may still be restoring it)."""
    if state.closed is not None:
        return Wait()
    n = state.round
    members = state.members(n)
    joined = state.nodes(n, "join")
    if members is None:
        return _joining(state, policy, n, joined, now, min_since)
    done = state.nodes(n, "done")
    if all(m.node in done for m in members):
        return Succeed()
    lost = [m.node for m in members if m.node not in joined and m.node not in done]
    if lost:
        if now < grace_until:
            return Wait(grace_until)
        return Advance(n, lost_reason(state.kvs, state.keys.prefix, lost,
                                      list(state.nodes(n, "wait"))))
    waiting = state.nodes(n, "wait")
    # Once a node finished, the job is ending: do not restart it for a newcomer.
    if waiting and not done and len(members) < policy.max_nodes:
        return Advance(n, f"node(s) waiting to join: {', '.join(sorted(waiting))}")
    return Wait()


def _joining(state: State, policy: Policy, n: int, joined: dict[str, KeyValue], now: float,
             min_since: float | None) -> Decision:
    if len(joined) < policy.min_nodes:
        return Wait()
    # The previous round's members keep their places: waiting nodes (spares) have no
    # workers to stop and so join a new round first; taken by arrival alone, they would
    # fill it and push out a healthy member that was still stopping its workers.
    staying = staying_members(state, n)
    chosen = sorted(joined.values(),
                    key=lambda kv: (_node_of(kv.key) not in staying, kv.create_revision))
    close = Close(n, tuple(chosen[: policy.max_nodes]))
    full = len(joined) >= policy.max_nodes and staying <= set(joined)
    if full or previous_round_rejoined(state, n, joined):
        return close
    last_call = (now if min_since is None else min_since) + policy.last_call_timeout
    return close if now >= last_call else Wait(last_call)


def staying_members(state: State, n: int) -> set[str]:
    """Members of round n-1 still alive (their join key of round n-1 is still there):
    they are on their way into round n, and have the first claim on its places."""
    if n == 0 or (members := state.members(n - 1)) is None:
        return set()
    return {m.node for m in members} & set(state.nodes(n - 1, "join"))


def previous_round_rejoined(state: State, n: int, joined: Mapping[str, KeyValue]) -> bool:
    """Every node still alive from round n-1 (members and waiters) joined round n: the
    round closes at once, so restarts skip the last call."""
    if n == 0 or state.members(n - 1) is None:
        return False
    alive = set(state.nodes(n - 1, "join")) | set(state.nodes(n - 1, "wait"))
    return bool(alive) and alive <= set(joined)


# transactions (comparisons and operations as data; every one carries O(1) of each)

Txn = tuple[list[JsonDict], list[JsonDict]]  # (comparisons, operations on success)


def round_guard(state: State) -> list[JsonDict]:
    """Comparisons: the round did not move on and the job is not closed."""
    keys = state.keys
    return [compare(keys.round, "MOD", "=", state.round_mod),
            compare(keys.closed, "VERSION", "=", 0)]


def advance_txn(state: State, reason: str, node: str) -> Txn:
    """Open round n+1 (unless someone did) and forget round n-1."""
    keys, n = state.keys, state.round
    ops = [put_op(keys.round, json.dumps({"round": n + 1, "reason": bounded(reason),
                                          "node": node}))]
    if n >= 1:
        ops += [delete_op(keys.result(n - 1)), delete_op(keys.master(n - 1)),
                delete_op(keys.cause(n - 1)), delete_op(keys.node(n - 1, ""), prefix=True)]
    return round_guard(state), ops


def close_job_txn(keys: Keys, *, ok: bool, reason: str, node: str) -> Txn:
    """Close the job for everyone, unless it is closed already (the first reason wins)."""
    value = json.dumps({"ok": ok, "reason": bounded(reason), "node": node})
    return [compare(keys.closed, "VERSION", "=", 0)], [put_op(keys.closed, value)]


def close_round_txn(state: State, decision: Close, view_revision: int) -> Txn:
    """Write round n's result. O(1) comparisons: etcd caps a txn at ``--max-txn-ops``
    (default 128), so one per member would fail past ~120 nodes. No join key changed or
    appeared since the leader's view; one that vanished meanwhile is a lost member, and
    the leader's next decision opens a new round for it."""
    keys, n = state.keys, decision.n
    guard = [*round_guard(state), compare(keys.result(n), "VERSION", "=", 0),
             compare(keys.node(n, "join"), "MOD", "<", view_revision + 1, prefix=True)]
    joins = state.joins(n)
    members = [{"node": joins[node].node, "local_world_size": joins[node].local_world_size,
                "snap": joins[node].snap}
               for node in (_node_of(kv.key) for kv in decision.chosen)]
    return guard, [put_op(keys.result(n), result_value(members))]


def _node_of(key: str) -> str:
    return key.rsplit("/", 1)[-1]
