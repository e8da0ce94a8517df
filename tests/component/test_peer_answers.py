"""What peers answer is untrusted input at the edge: a peer's ``/status`` (asked by the
cut-off check and by the check of a leave notice) and a status summary a peer wrote in
etcd. Garbage, including JSON nested deep enough to raise RecursionError in the parser,
counts as no answer and never escapes into the rendezvous' task group."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import anyio
import pytest
from aiohttp import web

from supervisor.core.leave_notice import GRACE, notice_body
from supervisor.rendezvous.etcd.cutoff import CutoffCheck, _summary_url
from supervisor.rendezvous.etcd.leave_notice import RECHECK, LeaveNotices
from supervisor.rendezvous.etcd.wire.client import EtcdClient, EtcdError
from tests.support.ports import free_port

RUN = "job-1"
DEEP = b"[" * 60_000  # json.loads raises RecursionError, not ValueError
BODIES = [DEEP, b"{", b"\xff", b'{"run_id": "job-1", "rendezvous": []}', b"[]"]
IDS = ["deep", "truncated", "not-utf8", "wrong-shape", "not-an-object"]


@asynccontextmanager
async def peer_answering(body: bytes) -> AsyncIterator[str]:
    """A real HTTP server (test data, standing in for a lying peer) at the URL yielded."""
    async def status(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/status", status)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def check(url: str) -> CutoffCheck:
    """A cut-off check of node "a" in round 3 with "b" and "c", which knows c's URL."""
    made = CutoffCheck(EtcdClient(["http://127.0.0.1:9"]), RUN, "a", ttl=6.0,
                       last_refresh_sent=lambda: 0.0, on_cut_off=lambda reason: None)
    made.round_started(3, ["a", "b", "c"])
    made._urls["c"] = url  # what learn_peers would have read from etcd
    return made


def test_a_summary_nested_too_deep_has_no_health_url() -> None:
    assert _summary_url("k", b'{"health_url": ' + DEEP) is None
    assert _summary_url("k", DEEP) is None


@pytest.mark.parametrize("body", BODIES, ids=IDS)
async def test_a_peer_answering_garbage_did_not_answer(body: bytes) -> None:
    with anyio.fail_after(10):
        async with peer_answering(body) as url, aiohttp.ClientSession() as session:
            report = await check(url)._ask_one(session, "c")
    assert not report.answered


@pytest.mark.parametrize("body", BODIES, ids=IDS)
async def test_a_leave_notice_the_peer_answers_with_garbage_is_not_confirmed(
        body: bytes) -> None:
    left: list[tuple[str, int]] = []

    async def etcd_answers(seconds: float) -> bool:
        raise AssertionError("asked only once the leave is confirmed")

    with anyio.fail_after(10):
        async with peer_answering(body) as url:
            notices = LeaveNotices(check(url), RUN, "a", on_peer_left=lambda *a: left.append(a),
                                   etcd_answers=etcd_answers)
            assert notices.receive(notice_body(RUN, "c", 3))[0] == 503  # not running yet
            async with anyio.create_task_group() as tg:
                await tg.start(notices.run)
                assert notices.receive(notice_body(RUN, "c", 3))[0] == 202
                while notices.counts["unconfirmed"] == 0:
                    await anyio.sleep(0.01)
                tg.cancel_scope.cancel()
    assert left == [] and notices.counts["confirmed"] == 0


async def test_a_notice_denied_once_is_checked_again_later_but_not_without_pause() -> None:
    """A forged notice (the named node still runs) must not keep that node's real notice
    out, nor make this node ask it at the attacker's pace: a denied notice may be checked
    again RECHECK seconds later. etcd here does not answer (a real client, a dead port)."""
    answer = {"body": json.dumps({"run_id": RUN, "rendezvous": {"etcd": {"left_round": None}}})}
    asked: list[float] = []
    left: list[tuple[str, int]] = []

    async def status(request: web.Request) -> web.Response:
        asked.append(time.monotonic())
        return web.Response(text=answer["body"], content_type="application/json")

    async def etcd_answers(seconds: float) -> bool:
        async with EtcdClient([f"http://127.0.0.1:{free_port()}"]) as client:
            try:
                await client.range("/", retry_window=0)
            except EtcdError:
                return False
        return True

    app = web.Application()
    app.router.add_get("/status", status)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        notices = LeaveNotices(check(url), RUN, "a", on_peer_left=lambda *a: left.append(a),
                               etcd_answers=etcd_answers)
        with anyio.fail_after(15):
            async with anyio.create_task_group() as tg:
                await tg.start(notices.run)
                began = time.monotonic()
                while notices.counts["unconfirmed"] == 0:  # the forged one, denied
                    assert notices.receive(notice_body(RUN, "c", 3))[0] == 202
                    await anyio.sleep(0.01)
                answer["body"] = json.dumps(
                    {"run_id": RUN, "rendezvous": {"etcd": {"left_round": 3}}})
                while not left:  # the real one, sent again and again until it is acted on
                    assert notices.receive(notice_body(RUN, "c", 3))[0] == 202
                    await anyio.sleep(0.01)
                tg.cancel_scope.cancel()
    finally:
        await runner.cleanup()
    assert left == [("c", 3)]
    assert len(asked) == 2 and asked[1] - asked[0] >= RECHECK, asked  # once denied, once more
    assert time.monotonic() - began >= RECHECK + GRACE
