"""A graceful leave told to the peers directly, at the edge (the rules: ``core.leave_notice``).

``tell(round)``: the leaving node POSTs ``/leave-notice`` to the health endpoints of the
peers it tells (their URLs read from etcd by the cut-off check, ``CutoffCheck``), each
request bounded by ``TIMEOUT``. ``receive(doc)``: the health server hands over a notice's
JSON body; an admitted notice is checked in the background (``run``) with the named node
itself and, if it confirms, reported to the owner (``on_peer_left(node, round)``): after
``GRACE`` if etcd does not serve a read by then (``etcd_answers``), else after ``FALLBACK``
(the owner ignores it if etcd has moved the round on meanwhile).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import anyio
from anyio.abc import TaskGroup, TaskStatus

from supervisor.core.leave_notice import (
    FALLBACK,
    GRACE,
    LeaveNotice,
    admit,
    confirms_leave,
    notice_body,
    parse_notice,
    tells,
)
from supervisor.rendezvous.etcd.cutoff import MAX_STATUS, CutoffCheck

logger = logging.getLogger(__name__)

TIMEOUT = 1.0  # s per request: a health endpoint answers in milliseconds when it is up
RECHECK = 1.0  # s before a notice the named node denied may be checked again
PATH = "/leave-notice"


class LeaveNotices:
    """Both ends of the notice for one node: telling its peers, hearing from them."""

    def __init__(self, peers: CutoffCheck, run_id: str, node_id: str, *,
                 on_peer_left: Callable[[str, int], None],
                 etcd_answers: Callable[[float], Awaitable[bool]]) -> None:
        self._peers = peers
        self._etcd_answers = etcd_answers
        self._run_id = run_id
        self._node_id = node_id
        self._on_peer_left = on_peer_left
        self._checks: TaskGroup | None = None  # while ``run`` runs
        self._session: aiohttp.ClientSession | None = None
        # when each notice (at most NOTIFY a round) may be checked again: inf while its
        # check runs and once confirmed; RECHECK after the named node denied it (a forged
        # notice must not keep the real one out, nor make this node ask without pause)
        self._next_check: dict[LeaveNotice, float] = {}
        self.counts = {"received": 0, "refused": 0, "confirmed": 0, "unconfirmed": 0}

    # hearing

    def receive(self, doc: object) -> tuple[int, dict[str, Any]]:
        """A notice's body (parsed JSON, untrusted) -> (HTTP status, JSON answer). Never
        blocks: the check runs in ``run``."""
        self.counts["received"] += 1
        notice = parse_notice(doc, self._run_id)
        if isinstance(notice, str):
            return self._refuse(400, notice)
        why = admit(notice, me=self._node_id, my_round=self._peers.round,
                    members=self._peers.members)
        if why is not None:
            return self._refuse(409, why)
        now = time.monotonic()
        if now >= self._next_check.get(notice, now):
            if self._checks is None or self._session is None:
                return self._refuse(503, "not ready to check notices")
            self._checks.start_soon(self._check, self._session, notice, now)
            self._next_check = {n: t for n, t in self._next_check.items()
                                if n.round >= notice.round}
            self._next_check[notice] = math.inf
            logger.info("%s says it left round %d; asking it", notice.node, notice.round)
        return 202, {"accepted": True, "node": notice.node, "round": notice.round}

    def _refuse(self, status: int, why: str) -> tuple[int, dict[str, Any]]:
        self.counts["refused"] += 1
        logger.debug("leave notice refused: %s", why)
        return status, {"accepted": False, "reason": why}

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Check each admitted notice (from ``task_status.started()`` on); forever."""
        async with aiohttp.ClientSession() as session, anyio.create_task_group() as tg:
            self._checks, self._session = tg, session
            task_status.started()
            try:
                await anyio.sleep_forever()
            finally:
                self._checks = self._session = None

    async def _check(self, session: aiohttp.ClientSession, notice: LeaveNotice,
                     at: float) -> None:
        url = self._peers.url(notice.node)
        doc: object = None
        if url is not None:
            try:
                with anyio.fail_after(TIMEOUT):
                    async with session.get(url + "/status") as resp:
                        doc = json.loads(await resp.content.read(MAX_STATUS))
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError,
                    RecursionError) as exc:
                logger.debug("%s at %s did not answer: %s", notice.node, url, exc)
        if not confirms_leave(doc, self._run_id, notice.round):
            self.counts["unconfirmed"] += 1
            if notice in self._next_check:
                self._next_check[notice] = time.monotonic() + RECHECK
            logger.info("%s did not confirm that it left round %d (at %s): notice ignored",
                        notice.node, notice.round, url or "no known URL")
            return
        self.counts["confirmed"] += 1
        # etcd's own news first, when etcd can give it
        commits = await self._etcd_answers(max(0.0, at + GRACE - time.monotonic()))
        await anyio.sleep(max(0.0, at + (FALLBACK if commits else GRACE) - time.monotonic()))
        self._on_peer_left(notice.node, notice.round)

    # telling

    async def tell(self, round_: int) -> int:
        """Tell the peers this node left ``round_``; how many took the notice."""
        body = notice_body(self._run_id, self._node_id, round_)
        urls = [u for p in tells(self._peers.members, self._node_id)
                if (u := self._peers.url(p)) is not None]
        took = 0

        async def tell_one(session: aiohttp.ClientSession, url: str) -> None:
            nonlocal took
            try:
                with anyio.fail_after(TIMEOUT):
                    async with session.post(url + PATH, json=body) as resp:
                        took += resp.status == 202
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                logger.debug("could not tell %s: %s", url, exc)

        if urls:
            async with aiohttp.ClientSession() as session, anyio.create_task_group() as tg:
                for url in urls:
                    tg.start_soon(tell_one, session, url)
        logger.info("told %d of %d peer(s) directly that this node left round %d", took,
                    len(urls), round_)
        return took
