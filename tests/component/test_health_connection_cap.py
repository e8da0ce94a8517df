"""The health server's connection cap against leave notices that never send their bodies,
and clients that go away (issue 52, finding 1): what is closed for room, what is counted,
what is logged. The flood against the real daemon is tests/e2e/test_probes_under_a_notice_flood.py.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any, cast

import anyio
import pytest
from aiohttp import web

from supervisor.health.connections import (
    ConnectionLedger,
    Pending,
    cap_connections,
    pending_on,
)
from supervisor.health.server import MAX_NOTICE_BODIES, make_app
from tests.support.health import Harness, running_server
from tests.support.metrics import metric_samples

NOTICE_HEADERS = (b"POST /leave-notice HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n")


def transports(*names: str) -> list[asyncio.BaseTransport]:
    return [cast(asyncio.BaseTransport, name) for name in names]


def test_ledger_closes_a_connection_reading_a_body_before_any_waiting_one() -> None:
    ledger = ConnectionLedger(2)
    a, b, c = object(), object(), object()
    ta, tb, tc = transports("ta", "tb", "tc")
    ledger.opened(a, ta)
    ledger.opened(b, tb)
    ledger.request_started(b)
    with ledger.reading_body(b):
        assert ledger.opened(c, tc) is tb  # b is newer than a, but waits for a body
    assert ledger.evicted == 1


def test_ledger_closes_a_read_post_first_and_never_a_read_probe() -> None:
    ledger = ConnectionLedger(3)
    a, b, c, d = object(), object(), object(), object()
    ta, tb, tc, td = transports("ta", "tb", "tc", "td")
    ledger.opened(a, ta)
    ledger.opened(b, tb)
    ledger.opened(c, tc)
    ledger.headers_read(a, probe=True)  # read, not yet handled: a probe is kept ...
    ledger.headers_read(c, probe=False)  # ... a POST goes first
    assert ledger.opened(d, td) is tc


def test_ledger_keeps_the_waiting_connections_that_hold_a_probe() -> None:
    held = {"ta": Pending.PROBE, "tb": Pending.NOTHING, "tc": Pending.OTHER}
    ledger = ConnectionLedger(3, lambda transport: held[cast(str, transport)])
    a, b, c, d = object(), object(), object(), object()
    ta, tb, tc, td = transports("ta", "tb", "tc", "td")
    for conn, transport in ((a, ta), (b, tb), (c, tc)):
        ledger.opened(conn, transport)
    assert ledger.opened(d, td) is tc  # a half-sent request before an idle connection
    ledger.closed(c)
    held["td"] = Pending.PROBE
    assert ledger.opened(object(), cast(asyncio.BaseTransport, "te")) is tb


def test_ledger_refuses_the_new_connection_when_every_other_holds_a_probe() -> None:
    ledger = ConnectionLedger(2, lambda transport: Pending.PROBE)
    a, b, c = object(), object(), object()
    ta, tb, tc = transports("ta", "tb", "tc")
    ledger.opened(a, ta)
    ledger.opened(b, tb)
    assert ledger.opened(c, tc) is tc and ledger.evicted == 0


class _Unread(asyncio.Protocol):
    """A server side that reads nothing: what the client sent stays in the kernel."""

    def __init__(self, made: asyncio.Future[asyncio.Transport]) -> None:
        self._made = made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.pause_reading()
        self._made.set_result(transport)


@pytest.mark.parametrize(("sent", "held"), [
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", Pending.PROBE),
    (b"HEAD /readyz HTTP/1.1\r\n\r\n", Pending.PROBE),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\n", Pending.OTHER),  # half sent
    (NOTICE_HEADERS, Pending.OTHER),
    (b"", Pending.NOTHING),
])
async def test_what_waits_unread_on_a_connection_is_peeked_not_read(
    sent: bytes, held: Pending
) -> None:
    loop = asyncio.get_running_loop()
    made: asyncio.Future[asyncio.Transport] = loop.create_future()
    server = await loop.create_server(lambda: _Unread(made), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with anyio.fail_after(10):
            async with await anyio.connect_tcp("127.0.0.1", port) as client:
                if sent:
                    await client.send(sent)
                transport = await made
                while sent and pending_on(transport) is Pending.NOTHING:
                    await anyio.sleep(0.01)  # until the bytes crossed loopback
                assert pending_on(transport) is held
                assert pending_on(transport) is held  # peeked: still there
                transport.close()
                assert pending_on(transport) is Pending.CLOSING
    finally:
        server.close()
        await server.wait_closed()


async def test_a_refused_connection_is_counted_and_logs_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A connection closed on arrival made aiohttp's connection task fail an assertion,
    and asyncio logged that traceback once per refused connection."""
    h = Harness()
    app = make_app(h.current, h.progress, h.metrics, h.current_lag)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    assert runner.server is not None
    # every waiting connection "holds a probe": the newcomer over the cap is refused
    cap_connections(runner.server, ConnectionLedger(2, lambda transport: Pending.PROBE),
                    h.metrics.record_http_eviction, h.metrics.record_http_refusal)
    listener = socket.create_server(("127.0.0.1", 0))
    site = web.SockSite(runner, listener)
    await site.start()
    port = listener.getsockname()[1]
    try:
        with anyio.fail_after(10):
            kept = [await anyio.connect_tcp("127.0.0.1", port) for _ in range(2)]
            for _ in range(5):
                refused = await anyio.connect_tcp("127.0.0.1", port)
                with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                    await refused.receive()
                await refused.aclose()
            for stream in kept:
                await stream.aclose()
            await asyncio.sleep(0)  # a turn for a failing connection task to be logged
    finally:
        await runner.cleanup()
    samples = metric_samples(h.metrics.render().decode())
    assert samples[("elastic_supervisor_http_connections_refused_total", ())] == 5
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_a_notice_whose_client_goes_away_mid_body_is_counted_499_not_500(
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = Harness()

    def sink(doc: object) -> tuple[int, dict[str, Any]]:
        raise AssertionError("no notice was complete")

    with anyio.fail_after(10):
        async with running_server(h, notices=sink) as (client, port):
            stream = await anyio.connect_tcp("127.0.0.1", port)
            await stream.send(NOTICE_HEADERS + b'{"run_id"')
            await stream.aclose()  # gone with its body half sent
            while True:  # the handler notices the close on its next turn
                text = await (await client.get("/metrics")).text()
                if 'path="/leave-notice"' in text:
                    break
    counted = {dict(labels)["code"]: value
               for (name, labels), value in metric_samples(text).items()
               if name == "elastic_supervisor_http_requests_total"
               and dict(labels)["path"] == "/leave-notice"}
    assert counted == {"499": 1}
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_notices_over_the_cap_are_answered_503_at_once() -> None:
    received: list[object] = []

    def sink(doc: object) -> tuple[int, dict[str, Any]]:
        received.append(doc)
        return 202, {"accepted": True}

    with anyio.fail_after(10):
        async with running_server(Harness(), notices=sink) as (client, port):
            waiting = []
            for _ in range(MAX_NOTICE_BODIES):
                stream = await anyio.connect_tcp("127.0.0.1", port)
                await stream.send(NOTICE_HEADERS)
                waiting.append(stream)
            # each of those handlers now waits for a body (up to 2 s); one more is refused
            while True:
                stream = await anyio.connect_tcp("127.0.0.1", port)
                await stream.send(NOTICE_HEADERS)
                reply = await stream.receive()
                await stream.aclose()
                if b" 503 " in reply.split(b"\r\n")[0]:
                    break
                assert b" 408 " in reply.split(b"\r\n")[0], reply  # the server was slow
            for stream in waiting:
                await stream.aclose()
            async with client.post("/leave-notice", json={"any": "thing"}) as resp:
                assert resp.status == 202  # the slots are free again
    assert received == [{"any": "thing"}]
