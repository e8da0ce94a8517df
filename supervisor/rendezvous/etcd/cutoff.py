"""The cut-off check at the edge: ask the round's peers whether they reach etcd.

The rule is ``supervisor.core.partition.judge``; this module does its I/O. While etcd
answers, it remembers the health URLs of up to ``PEERS`` peers of the node's current round,
and of the (up to 3) members that would tell it of their leave (``core.leave_notice``;
the notice itself is ``rendezvous.leave_notice``), from their status summaries
(``summary.summary_prefix``: one read of a few keys per round). While etcd does not
answer, it asks those peers' ``/status`` every ``PROBE_INTERVAL`` (each request bounded by
``PROBE_TIMEOUT``) and tells its owner once the rule says this node is cut off
(``on_cut_off(reason)``). No new coordination service: the peers' health endpoints, which
exist anyway, are the witnesses.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence

import aiohttp
import anyio

from supervisor.core.leave_notice import told_by
from supervisor.core.partition import (
    Cutoff,
    PeerReport,
    Verdict,
    judge,
    parse_peer_status,
    peers_to_ask,
)
from supervisor.rendezvous.etcd.keys import Keys
from supervisor.rendezvous.etcd.summary import summary_prefix
from supervisor.rendezvous.etcd.wire.client import EtcdClient, EtcdError
from supervisor.rendezvous.etcd.wire.decode import Join, Summary, decode, peer_health_url

logger = logging.getLogger(__name__)

PEERS = 3  # peers asked: enough witnesses, O(1) work per node whatever the job's size
PROBE_INTERVAL = 1.0  # seconds between two rounds of questions during an outage
PROBE_TIMEOUT = 1.0  # a peer's health endpoint answers in milliseconds when it is up
MAX_STATUS = 64 * 1024  # bytes read of a peer's /status at most
RELEARN_INTERVAL = 2.0  # seconds before reading a missing peer summary again


class CutoffCheck:
    """Decides, during an etcd outage, whether this node is the one cut off.

    ``last_refresh_sent`` gives when the last lease refresh that etcd answered was sent
    (``LeaseKeeper.last_refresh_sent``); ``on_cut_off`` is called once per outage when the
    rule says stop."""

    def __init__(self, client: EtcdClient, run_id: str, node_id: str, *, ttl: float,
                 last_refresh_sent: Callable[[], float],
                 on_cut_off: Callable[[str], None]) -> None:
        self._client = client
        self._run_id = run_id
        self._node_id = node_id
        self._ttl = ttl
        self._last_refresh_sent = last_refresh_sent
        self._on_cut_off = on_cut_off
        self._round = -1
        self._members: tuple[str, ...] = ()
        self._urls: dict[str, str] = {}  # peer node id -> health URL
        self._in_outage = False
        self._version = 0  # bumped on every change of round or reachability
        self._wake = anyio.Event()
        self.last_verdict: Verdict | None = None

    @property
    def round(self) -> int:
        """The round this node runs (-1: none, it is between rounds)."""
        return self._round

    @property
    def members(self) -> tuple[str, ...]:
        """The members of that round, in group-rank order."""
        return self._members

    def url(self, node: str) -> str | None:
        """The health URL of a peer, if this node read it (``learn_peers``)."""
        return self._urls.get(node)

    def round_started(self, round_: int, members: Sequence[str]) -> None:
        """This node runs round ``round_`` with ``members`` (group-rank order)."""
        self._round, self._members = round_, tuple(members)
        self._poke()

    def round_ended(self) -> None:
        """This node left its round (it joins the next one): nothing to guard."""
        self._round = -1
        self._poke()

    def outage_began(self) -> None:
        self._in_outage = True
        self._poke()

    def outage_ended(self) -> None:
        self._in_outage = False
        self._poke()

    def _poke(self) -> None:
        self._version += 1
        self._wake.set()
        self._wake = anyio.Event()

    async def _wait_change(self, seen: int) -> None:
        while self._version == seen:
            await self._wake.wait()

    async def run(self) -> None:
        """Forever: learn the peers' URLs for each round; during outages, ask them."""
        while True:
            seen, complete = self._version, True
            if self._round >= 0 and not self._in_outage:
                complete = await self.learn_peers()
            if self._round >= 0 and self._in_outage:
                await self._ask_until_decided()
            # a peer that has not published its summary yet: read again a bit later
            with anyio.move_on_after(math.inf if complete else RELEARN_INTERVAL):
                await self._wait_change(seen)

    async def learn_peers(self) -> bool:
        """Read the health URLs of the peers this node would ask, and of those that would
        tell it of their leave (``core.leave_notice``) (best effort); whether every one is
        known. Called once more before the round's workers start, so that a cut right
        after the start finds them known."""
        peers = peers_to_ask(self._members, self._node_id, PEERS)
        peers += [p for p in told_by(self._members, self._node_id) if p not in peers]
        wanted = [p for p in peers if p not in self._urls]
        for peer in wanted:
            try:
                with anyio.fail_after(self._client.timeout):
                    url = await self._peer_url(peer)
            except (EtcdError, TimeoutError) as exc:
                logger.debug("cannot read %s's status summary: %s", peer, exc)
                return False
            if url is None:
                logger.debug("no health URL for %s yet", peer)
                return False
            self._urls[peer] = url
        if wanted:
            logger.info("round %d: the peers to ask or to be told by are %s", self._round,
                        ", ".join(f"{p} at {self._urls[p]}" for p in wanted))
        return True

    async def _peer_url(self, peer: str) -> str | None:
        """The health URL in ``peer``'s status summary, if it is one on the address the peer
        joined this round with (two reads: the summary and the join key)."""
        summary = await self._client.get(summary_prefix(self._run_id) + peer)
        url = _summary_url(summary.key, summary.value) if summary is not None else None
        if url is None:
            return None
        key = Keys(self._run_id).node(self._round, "join", peer)
        kv = await self._client.get(key)
        join = decode("nodes/join", key, kv.value, Join) if kv is not None else None
        return peer_health_url(url, join.addr if join is not None else None)

    async def learn_all(self, members: Sequence[str], round_: int) -> None:
        """Read the health URLs of every one of ``members`` (of round ``round_``) not known
        yet, for the lost-peer check (``peers``): two reads in all, the job's status
        summaries and the round's join keys, each URL kept only if it is on the address
        the peer joined with (as ``_peer_url``). Unbounded: the caller bounds it; an etcd
        error leaves them unknown."""
        wanted = {m for m in members if m != self._node_id and m not in self._urls}
        if not wanted:
            return
        prefix, joins = summary_prefix(self._run_id), Keys(self._run_id).node(round_, "join")
        try:
            summaries = await self._client.range(prefix, prefix=True, retry_window=0)
            joined = await self._client.range(joins, prefix=True, retry_window=0)
        except EtcdError as exc:
            logger.debug("cannot read the peers' status summaries: %s", exc)
            return
        addrs: dict[str, str] = {}
        for kv in joined.kvs:
            join = decode("nodes/join", kv.key, kv.value, Join)
            if join is not None:
                addrs[kv.key[len(joins):]] = join.addr
        for kv in summaries.kvs:
            node = kv.key[len(prefix):]
            url = _summary_url(kv.key, kv.value) if node in wanted else None
            checked = peer_health_url(url, addrs.get(node)) if url is not None else None
            if checked is not None:
                self._urls[node] = checked

    async def _ask_until_decided(self) -> None:
        round_ = self._round
        peers = peers_to_ask(self._members, self._node_id, PEERS)
        async with aiohttp.ClientSession() as session:
            while self._in_outage and self._round == round_:
                seen = self._version
                reports = await self._ask(session, peers)
                verdict = judge(my_round=round_, last_refresh_sent=self._last_refresh_sent(),
                                now=time.monotonic(), ttl=self._ttl,
                                max_rtt=self._client.timeout, reports=reports)
                last = self.last_verdict
                if last is None or verdict.action is not last.action:
                    logger.info("etcd unreachable; cut-off check: %s (%s)",
                                verdict.action.value, verdict.reason)
                self.last_verdict = verdict
                if verdict.action is Cutoff.STOP:
                    self._on_cut_off(verdict.reason)
                    return
                with anyio.move_on_after(PROBE_INTERVAL):
                    await self._wait_change(seen)

    async def _ask(self, session: aiohttp.ClientSession, peers: list[str]
                   ) -> list[PeerReport]:
        reports: dict[str, PeerReport] = {}

        async def ask(peer: str) -> None:
            reports[peer] = await self._ask_one(session, peer)

        async with anyio.create_task_group() as tg:
            for peer in peers:
                tg.start_soon(ask, peer)
        return [reports[p] for p in peers]

    async def _ask_one(self, session: aiohttp.ClientSession, peer: str) -> PeerReport:
        url = self._urls.get(peer)
        if url is None:
            return PeerReport(peer, answered=False)
        try:
            with anyio.fail_after(PROBE_TIMEOUT):
                async with session.get(url + "/status") as resp:
                    body = await resp.content.read(MAX_STATUS)
            doc = json.loads(body)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, RecursionError) as exc:
            logger.debug("peer %s at %s did not answer: %s", peer, url, exc)
            return PeerReport(peer, answered=False)
        return parse_peer_status(peer, doc, self._run_id)


def _summary_url(key: str, value: bytes) -> str | None:
    """The ``health_url`` of a status summary that decodes (``decode.Summary``)."""
    summary = decode("status", key, value, Summary)
    return summary.health_url if summary is not None else None
