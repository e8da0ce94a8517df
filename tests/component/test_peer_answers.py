"""What peers answer is untrusted input at the edge: a peer's ``/status`` (asked by the
cut-off check and by the check of a leave notice) and a status summary a peer wrote in
etcd. Garbage, including JSON nested deep enough to raise RecursionError in the parser,
counts as no answer and never escapes into the rendezvous' task group."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import anyio
import pytest
from aiohttp import web

from supervisor.core.leave_notice import notice_body
from supervisor.rendezvous.etcd_client import EtcdClient
from supervisor.rendezvous.etcd_cutoff import CutoffCheck, _health_url
from supervisor.rendezvous.leave_notice import LeaveNotices

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
    assert _health_url(b'{"health_url": ' + DEEP) is None
    assert _health_url(DEEP) is None


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
