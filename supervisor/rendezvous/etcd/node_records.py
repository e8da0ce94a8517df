"""Node health facts in etcd: each round's root cause and each node's failure record.

Keys, next to the rendezvous' own (see ``keys``)::

    ctl/cause/N         {"node", "round", "signature", ...}  the first failure of round N
                                                              recorded by any node (a
                                                              create-only txn: first wins);
                                                              deleted with round N's keys
    health/<node>       {"node", "member", "failures", "quarantined"}  a node's root-cause
                                                              failures in the window and its
                                                              quarantine; bound to a lease of
                                                              the window's length (it lives
                                                              until its window ends), not
                                                              to the agent's lease; a
                                                              quarantined record has no
                                                              lease: it stays until an
                                                              operator clears it

``<node>`` is the node's health id: ``--rdzv-conf node_id=`` when given, else the host
name, so a supervisor restarted on the same host finds its record. Clearing a node's
record lets it back in: ``elastic-supervisor node clear --rdzv-endpoint ... --rdzv-id JOB
NODE`` (or ``etcdctl del /elastic-supervisor/JOB/health/NODE``).

Every value read here goes through the job's one decoder (``rendezvous/etcd/wire/decode.py``, rows
``ctl/cause`` and ``health``): a malformed value is counted, logged once and treated as
absent, never a crash.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec

from supervisor.core import nodehealth as nh
from supervisor.rendezvous.base import RendezvousError
from supervisor.rendezvous.etcd.wire import decode
from supervisor.rendezvous.etcd.wire.client import (
    EtcdClient,
    EtcdError,
    KeyValue,
    compare,
    put_op,
)
from supervisor.rendezvous.etcd.wire.watch import open_prefix_view

logger = logging.getLogger(__name__)

_CAS_ATTEMPTS = 20
_Update = Callable[[nh.NodeRecord, list[nh.NodeRecord], float],
                   tuple[nh.NodeRecord, nh.Judgement]]


def cause_key(prefix: str, n: int) -> str:
    """``ctl/cause/N`` of the job under ``prefix`` (``/elastic-supervisor/<run_id>/``)."""
    return f"{prefix}ctl/cause/{n}"


def health_prefix(prefix: str) -> str:
    return f"{prefix}health/"


def decode_cause(key: str, value: bytes) -> nh.RoundCause | None:
    """A ``ctl/cause/N`` value, or None if it is not one (counted by the decoder)."""
    return decode.decode("ctl/cause", key, value, nh.RoundCause)


def decode_record(key: str, value: bytes) -> nh.NodeRecord | None:
    """A ``health/<node>`` value, or None if it is not one (counted by the decoder)."""
    return decode.decode("health", key, value, nh.NodeRecord)


def records_of(kvs: Mapping[str, KeyValue] | list[KeyValue], prefix: str) -> list[nh.NodeRecord]:
    """The node records among ``kvs`` (the job's keys, or a range of ``health/``)."""
    base = health_prefix(prefix)
    items = kvs.values() if isinstance(kvs, Mapping) else kvs
    found = []
    for kv in items:
        if kv.key.startswith(base):
            record = decode_record(kv.key, kv.value)
            if record is not None and record.node == kv.key[len(base):]:
                found.append(record)
    return found


def lost_reason(kvs: Mapping[str, KeyValue], prefix: str, lost: list[str],
                waiting: list[str]) -> str:
    """Why the leader opens a new round after losing ``lost`` (member ids): a member that
    quarantined itself says so, and a spare waiting to take its place too (the causes
    ``node_quarantined`` and ``spare_admitted`` of goodput)."""
    held = {r.member for r in records_of(kvs, prefix) if r.quarantined is not None}
    gone = [m for m in lost if m in held]
    if not gone:
        text = f"node(s) lost: {', '.join(lost)}"
    else:
        others = [m for m in lost if m not in held]
        text = f"node(s) quarantined: {', '.join(gone)}"
        if others:
            text += f"; node(s) lost: {', '.join(others)}"
    if waiting:
        text += f"; spare(s) waiting: {', '.join(sorted(waiting))}"
    return text


@asynccontextmanager
async def _errors(what: str) -> AsyncIterator[None]:
    try:
        yield
    except EtcdError as exc:
        raise RendezvousError(f"node health: {what} failed: {exc}") from exc


class EtcdNodeLedger:
    """A node's health facts in the job's etcd (the ``NodeLedger`` of the etcd backends)."""

    def __init__(self, client: EtcdClient, prefix: str, node: str, member: str,
                 limits: nh.Limits, *, spare: Callable[[], bool] | None = None) -> None:
        self.client = client
        self.prefix = prefix
        self.node = node
        self.member = member
        self.limits = limits
        self._spare = spare  # () -> bool: the rendezvous says this node waits as a spare
        self._key = health_prefix(prefix) + node
        self.replaceable = True

    @property
    def spare(self) -> bool:
        return self._spare() if self._spare is not None else False

    async def claim_root_cause(self, cause: nh.RoundCause) -> nh.RoundCause:
        """Record ``cause`` as its round's root cause unless a node did first; the winner."""
        async with _errors("recording the round's root cause"):
            key = cause_key(self.prefix, cause.round)
            value = msgspec.json.encode(cause)
            for _ in range(_CAS_ATTEMPTS):
                result = await self.client.txn([compare(key, "VERSION", "=", 0)],
                                               [put_op(key, value)])
                if result.succeeded:
                    return cause
                kv = await self.client.get(key)
                if kv is None:
                    continue  # the round's keys were just deleted: try again
                winner = decode_cause(kv.key, kv.value)
                return winner if winner is not None else cause
            return cause

    async def record_failure(self, failure: nh.NodeFailure) -> nh.Judgement:
        """Add a root-cause failure to this node's record and judge it (quarantine?)."""

        def update(mine: nh.NodeRecord, others: list[nh.NodeRecord],
                   now: float) -> tuple[nh.NodeRecord, nh.Judgement]:
            mine = nh.with_failure(mine, failure, now, self.limits.window, self.member)
            judgement = nh.judge(mine, others, self.limits, now)
            if judgement.quarantine:
                mine = nh.quarantined(mine, judgement.reason, now)
            return mine, judgement

        return await self._update(update)

    async def quarantine(self, reason: str) -> None:
        """Mark this node quarantined (its node check failed: evidence about the node,
        so the job-wide cap does not apply)."""

        def update(mine: nh.NodeRecord, others: list[nh.NodeRecord],
                   now: float) -> tuple[nh.NodeRecord, nh.Judgement]:
            mine = nh.quarantined(msgspec.structs.replace(mine, member=self.member), reason,
                                  now)
            return mine, nh.Judgement(nh.Verdict.QUARANTINE, reason)

        await self._update(update)

    async def _update(self, update: _Update) -> nh.Judgement:
        """Read every node's record, change this node's, write it back unless any record
        changed meanwhile (one guarded txn: two nodes cannot both pass the cap)."""
        async with _errors("updating the node record"):
            base = health_prefix(self.prefix)
            for _ in range(_CAS_ATTEMPTS):
                found = await self.client.range(base, prefix=True)
                records = records_of(list(found.kvs), self.prefix)
                mine = next((r for r in records if r.node == self.node), nh.NodeRecord(self.node))
                others = [r for r in records if r.node != self.node]
                new, judgement = update(mine, others, time.time())
                lease = 0
                if new.quarantined is None:  # gone by itself once its window ends
                    lease, _ = await self.client.lease_grant(max(1, math.ceil(self.limits.window)))
                guard = [compare(base, "MOD", "<", found.revision + 1, prefix=True)]
                result = await self.client.txn(guard, [put_op(self._key, msgspec.json.encode(new),
                                                              lease=lease)])
                if result.succeeded:
                    return judgement
            raise EtcdError("node health records too contended to update")

    async def held(self) -> nh.Quarantine | None:
        """This node's quarantine, if its record holds one."""
        async with _errors("reading the node record"):
            kv = await self.client.get(self._key)
            record = decode_record(kv.key, kv.value) if kv is not None else None
            return record.quarantined if record is not None else None

    async def wait_cleared(self) -> None:
        """Until this node's quarantine is cleared (its record deleted or rewritten)."""
        async with (_errors("watching the node record"),
                    open_prefix_view(self.client, self._key) as view):
            while True:
                seen = view.version
                kv = view.kvs.get(self._key)
                record = decode_record(kv.key, kv.value) if kv is not None else None
                if record is None or record.quarantined is None:
                    return
                await view.wait_changed(seen)

    async def job_view(self) -> dict[str, Any]:
        """Every node's record, for ``/status``: quarantined nodes and their reasons."""
        try:
            with anyio.fail_after(self.client.timeout):
                found = await self.client.range(health_prefix(self.prefix), prefix=True,
                                                retry_window=None)
        except (EtcdError, TimeoutError):
            return {}
        return job_view(records_of(list(found.kvs), self.prefix), time.time(),
                        self.limits.window)


MAX_SHOWN_NODES = 32
"""Nodes listed in ``/status``'s node-health section (quarantined ones, and those with the
most failures): with each record's texts bounded by ``decode``, the section stays a few
tens of KiB whatever the job's size or what its nodes wrote."""


def job_view(records: list[nh.NodeRecord], now: float, window: float) -> dict[str, Any]:
    """The job's node records as ``/status`` shows them, bounded as a whole."""
    held = [r for r in records if r.quarantined is not None]
    counts = sorted(((len(nh.recent(r.failures, now, window)), r.node) for r in records),
                    reverse=True)
    view: dict[str, Any] = {
        "quarantined": [{"node": r.node, "reason": r.quarantined.reason,
                         "at": r.quarantined.at}
                        for r in held[:MAX_SHOWN_NODES] if r.quarantined is not None],
        "failures": {node: count for count, node in counts[:MAX_SHOWN_NODES]},
    }
    left_out = max(0, len(held) - MAX_SHOWN_NODES) + max(0, len(counts) - MAX_SHOWN_NODES)
    if left_out:
        view["not_shown"] = left_out
    return view


async def clear_node(client: EtcdClient, prefix: str, node: str) -> bool:
    """Delete ``node``'s record (the operator's ``node clear``); whether there was one."""
    return await client.delete(health_prefix(prefix) + node) > 0
