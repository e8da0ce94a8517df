"""A job-wide view in etcd: each supervisor publishes a small summary of itself.

Key ``/elastic-supervisor-status/<run_id>/<node_id>``, beside the rendezvous keys and
never under them, so that no agent's membership watch hears about summaries. The key is
bound to the node's rendezvous lease (it vanishes with the node) and written only when
its content changes, at most once per ``MIN_INTERVAL``: the summary holds no
time-varying field (goodput totals are closed sums plus the open segment's kind and
start, from which a reader computes the figures at its own time). At idle nothing is
written; every state change of a node costs one put.

``read_summaries`` is what ``elastic-supervisor status --rdzv-endpoint`` uses: one range
read of the prefix, no node's HTTP port involved.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable
from typing import Any, Protocol

import anyio
import msgspec

from supervisor.core.goodput import Ledger, totals
from supervisor.core.nodehealth import NodeRecord, record_text
from supervisor.core.statusview import StatusView
from supervisor.rendezvous.base import JobStatusStore
from supervisor.rendezvous.etcd.wire.client import EtcdClient, EtcdError, hedge_delay
from supervisor.rendezvous.etcd.wire.decode import Summary, decode, printable

logger = logging.getLogger(__name__)

STATUS_ROOT = "/elastic-supervisor-status"
MIN_INTERVAL = 1.0  # seconds between two writes of one node's summary
RETRY_INTERVAL = 5.0  # after a failed write
MAX_VALUE = 4096  # bytes; a summary is a few hundred


def summary_prefix(run_id: str) -> str:
    """The prefix under which a job's summaries live."""
    return f"{STATUS_ROOT}/{run_id}/"


def node_summary(
    snapshot: StatusView, *, node_id: str, host: str, health_url: str | None,
    mono_to_wall: float,
) -> dict[str, Any]:
    """The summary of one node: nothing in it changes unless the node's state does."""
    failure = snapshot.last_failure
    health = snapshot.node_health or {}
    return {
        "node_id": node_id,
        # a node waiting to join has no rank yet
        "node_rank": snapshot.rendezvous.group_rank if snapshot.rendezvous.members else None,
        "host": host,
        # a spare waits in the rendezvous phase: say what it is
        "state": "spare" if health.get("spare") else snapshot.phase,
        "health": ({"state": health.get("state"),
                    "reason": record_text(str(health.get("reason") or ""))} if health else None),
        "attempt": snapshot.attempt,
        "restarts": snapshot.restart_count,
        "max_restarts": snapshot.max_restarts,
        "world_size": snapshot.world_size,
        "health_url": health_url,
        # one printable line: readers drop a summary that is not (decode.Summary)
        "last_failure": record_text(failure.description) if failure else None,
        "goodput": _goodput(snapshot.goodput, mono_to_wall),
    }


def _goodput(ledger: Ledger | None, mono_to_wall: float) -> dict[str, Any] | None:
    if ledger is None:
        return None
    closed = totals(ledger, ledger.since)  # the open segment at zero: stable between changes
    return {
        "startup": round(closed.startup, 3),
        "productive": round(closed.productive, 3),
        "lost": {k: round(v, 3) for k, v in closed.lost_by_cause.items() if v},
        "idle": round(closed.idle, 3),
        "unknown": round(closed.unknown, 3),
        "failures": ledger.failures,
        "seen": ledger.seen,  # some rank showed progress: else the figures are unknown
        "segment": ledger.kind.value,
        "cause": ledger.cause,
        "since": round(ledger.since + mono_to_wall, 3),  # wall clock
        "started": round(ledger.started_at + mono_to_wall, 3),
        "ended": None if ledger.ended_at is None else round(ledger.ended_at + mono_to_wall, 3),
    }


def goodput_now(summary: dict[str, Any], now_wall: float) -> dict[str, float | None] | None:
    """A summary's goodput figures at ``now_wall`` (the open segment counted up to it);
    ``ratio`` is None when part of the time is unknown (no progress signal)."""
    g = summary.get("goodput")
    if not isinstance(g, dict):
        return None
    try:
        end = float(g["ended"]) if g.get("ended") is not None else now_wall
        open_part = max(0.0, end - float(g["since"]))
        lost = {str(k): float(v) for k, v in (g.get("lost") or {}).items()}
        figures = {"startup": float(g["startup"]), "productive": float(g["productive"]),
                   "idle": float(g["idle"]), "unknown": float(g.get("unknown") or 0.0)}
        if g.get("segment") == "lost":
            cause = str(g.get("cause") or "other")
            lost[cause] = lost.get(cause, 0.0) + open_part
        elif g.get("segment") in figures:
            figures[str(g["segment"])] += open_part
        wall = max(0.0, end - float(g["started"]))
    except (KeyError, TypeError, ValueError):
        return None
    seen = g.get("seen") is not False  # absent: a summary written before it was kept
    result: dict[str, float | None] = {**figures, "lost": sum(lost.values()), "wall": wall,
                                       "seen": float(seen)}
    result["ratio"] = (None if figures["unknown"] > 0 or not seen else  # time not seen
                       figures["productive"] / wall if wall > 0 else 0.0)
    return result


class SummaryPublisher:
    """Writes this node's summary whenever it changes (rate-limited), bound to the lease."""

    def __init__(
        self,
        client: EtcdClient,
        run_id: str,
        node_id: str,
        lease: Callable[[], int],
        summarise: Callable[[], dict[str, Any]],
        *,
        min_interval: float = MIN_INTERVAL,
    ) -> None:
        self.client = client
        self.key = summary_prefix(run_id) + node_id
        self._lease = lease
        self._summarise = summarise
        self._min_interval = min_interval
        self._written: tuple[str, int] | None = None  # (value, lease) last written
        self.writes = 0  # puts done, for the writes-per-hour figure

    async def publish_changes(self, wait_changed: Callable[[], Any]) -> None:
        """Forever: write if the summary (or the lease) changed, then wait for a change."""
        while True:
            await self.write_if_changed()
            await wait_changed()
            await anyio.sleep(self._min_interval)  # rate limit: coalesce a burst of changes

    async def write_if_changed(self) -> bool:
        """One put if the content or lease differs from the last write; False on error."""
        lease = self._lease()
        if not lease:
            return True  # no lease yet (or lost): nothing can be bound to it
        summary = self._summarise()
        value = json.dumps(summary, separators=(",", ":"), sort_keys=True)
        if len(value) > MAX_VALUE:  # a host name or failure text out of bounds: the essentials
            essentials = {k: summary.get(k) for k in ("node_id", "node_rank", "state", "attempt",
                                                       "restarts")}
            value = json.dumps(essentials, separators=(",", ":"), sort_keys=True)
        if self._written == (value, lease):
            return True
        try:
            await self.client.put(self.key, value, lease=lease)
        except EtcdError as exc:
            # during an outage the rendezvous has said so once already: one line per error
            outage = self.client.reachability.unreachable_since is not None
            logger.log(logging.DEBUG if outage else logging.WARNING,
                       "cannot publish this node's status summary: %s", exc)
            await anyio.sleep(RETRY_INTERVAL)
            return False
        self._written = (value, lease)
        self.writes += 1
        return True


async def read_summaries(client: EtcdClient, run_id: str) -> list[dict[str, Any]]:
    """Every node's summary of a job, ordered by node rank then id; bad values skipped."""
    rows, _ = await read_job(client, run_id)
    return rows


async def read_job(client: EtcdClient, run_id: str) -> tuple[list[dict[str, Any]], int]:
    """(every valid summary of the job as plain data, ordered by node rank then id; how
    many keys were skipped as bad). Each row passed ``decode``'s bounded ``Summary``
    schema: a sibling's list for a dict, an infinite number, a huge integer or a key that
    is not UTF-8 costs one skipped row, not the view."""
    result = await client.range(summary_prefix(run_id), prefix=True)
    rows, skipped = [], 0
    for kv in result.kvs:
        row = (decode("status", kv.key, kv.value, Summary, report=False)
               if printable(kv.key) else None)
        if row is None or "\ufffd" in kv.key:
            skipped += 1
            continue
        rows.append(msgspec.to_builtins(row))
    # a quarantined node's summary went with its lease: its record gives its row
    shown = {str(r.get("node_id")) for r in rows}
    rows += [{"node_id": r.node, "node_rank": None, "host": "-", "state": "quarantined",
              "last_failure": r.quarantined.reason[:300]}
             for r in await _quarantined(client, run_id)
             if r.quarantined is not None and r.node not in shown and r.member not in shown]
    rows.sort(key=lambda d: (_int(d.get("node_rank")), str(d.get("node_id"))))
    return rows, skipped


async def _quarantined(client: EtcdClient, run_id: str) -> list[NodeRecord]:
    from supervisor.rendezvous.etcd.keys import Keys
    from supervisor.rendezvous.etcd.node_records import health_prefix, records_of

    prefix = Keys(run_id).prefix
    found = await client.range(health_prefix(prefix), prefix=True)
    return records_of(list(found.kvs), prefix)


def _int(value: object) -> int:
    return value if isinstance(value, int) else 1 << 30


def mono_to_wall_offset() -> float:
    """Add to a monotonic time to get wall-clock seconds (now)."""
    return time.time() - time.monotonic()


class StatusViews(Protocol):
    """Where the read model publishes its status views (``views.StatusHub``)."""

    current: StatusView
    version: int

    async def wait_changed(self, seen: int) -> int: ...


async def publish_summaries(
    rendezvous: JobStatusStore, hub: StatusViews, health_url: Callable[[], str | None],
    *, host: str | None = None,
) -> None:
    """Run this node's publisher until cancelled (its own client; same TLS and auth)."""
    config = rendezvous.config
    client = EtcdClient(config.endpoints, timeout=config.request_timeout, tls=config.tls,
                        user=config.user, password=config.password,
                        hedge_after=hedge_delay(config.request_timeout))
    name = host or socket.gethostname()
    offset = mono_to_wall_offset()

    def summarise() -> dict[str, Any]:
        return node_summary(hub.current, node_id=rendezvous.node_id, host=name,
                            health_url=health_url(), mono_to_wall=offset)

    publisher = SummaryPublisher(client, config.run_id, rendezvous.node_id,
                                 lambda: rendezvous.lease_id, summarise)
    seen = hub.version

    async def wait_changed() -> None:
        nonlocal seen
        seen = await hub.wait_changed(seen)

    try:
        await publisher.publish_changes(wait_changed)
    finally:
        logger.debug("published %d status summaries", publisher.writes)
        with anyio.CancelScope(shield=True):
            await client.aclose()
