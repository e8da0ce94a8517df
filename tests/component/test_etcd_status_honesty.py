"""``/status`` never says "etcd reachable" while the node's own watch is dead: a member
that answers requests but refuses watch streams (through a real etcd behind a small
forwarding proxy) shows ``reachable: false`` with ``requests_answered: true``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web

from supervisor.rendezvous.etcd.backend import EtcdRendezvous
from supervisor.rendezvous.etcd.config import EtcdRendezvousConfig
from tests.support.etcd import EtcdMember

NO_LEADER = (b'{"error":{"grpc_code":14,"http_code":503,"message":"etcdserver: no leader",'
             b'"http_status":"Service Unavailable"}}')

pytestmark = pytest.mark.etcd


class WatchRefusingProxy:
    """Forwards etcd's gateway; once ``refuse()`` is called, open watch streams end and
    new ones get etcd's "no leader" answer, while every other request is still served."""

    def __init__(self, target: str, session: aiohttp.ClientSession) -> None:
        self.target = target
        self.session = session
        self.refusing = False
        self._streams: set[anyio.CancelScope] = set()

    def refuse(self) -> None:
        self.refusing = True
        for scope in self._streams:
            scope.cancel()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.path == "/v3/watch" and self.refusing:
            return web.Response(body=NO_LEADER, status=503, content_type="application/json")
        upstream = await self.session.post(self.target + request.path, data=body,
                                           headers={"Content-Type": "application/json"})
        if request.path != "/v3/watch":
            async with upstream:
                return web.Response(body=await upstream.read(), status=upstream.status,
                                    content_type="application/json")
        resp = web.StreamResponse(status=upstream.status)
        resp.content_type = "application/json"
        await resp.prepare(request)
        with anyio.CancelScope() as scope:
            self._streams.add(scope)
            try:
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
            finally:
                self._streams.discard(scope)
                upstream.close()
        return resp


@asynccontextmanager
async def proxy_for(member: EtcdMember) -> AsyncIterator[tuple[str, WatchRefusingProxy]]:
    async with aiohttp.ClientSession() as session:
        proxy = WatchRefusingProxy(member.endpoint, session)
        app = web.Application()
        app.router.add_post("/{tail:.*}", proxy.handle)
        runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            yield f"http://127.0.0.1:{port}", proxy
        finally:
            proxy.refuse()
            await runner.cleanup()


async def test_status_is_not_reachable_while_the_watch_is_dead(server: EtcdMember) -> None:
    went: dict[bool, anyio.Event] = {True: anyio.Event(), False: anyio.Event()}

    def on_event(kind: str, **fields: Any) -> None:
        if kind == "etcd_watch":
            went[bool(fields["live"])].set()

    async with proxy_for(server) as (endpoint, proxy):
        config = EtcdRendezvousConfig(endpoints=(endpoint,), run_id="honest", min_nodes=1,
                                      max_nodes=1, node_id="node-0", join_timeout=20,
                                      last_call_timeout=0.3, lease_ttl=3, request_timeout=1)
        rdzv = EtcdRendezvous(config, on_event=on_event)
        async with anyio.create_task_group() as tg:
            await tg.start(rdzv.run)
            with anyio.fail_after(10):
                await went[True].wait()  # the watch task opened its stream
            live = rdzv.outage_status()
            proxy.refuse()
            with anyio.fail_after(10):
                await went[False].wait()
                await rdzv.restart_count()  # a request is answered meanwhile
            dead = rdzv.outage_status()
            await rdzv.aclose()
    assert live["reachable"] and live["requests_answered"], live
    assert dead["requests_answered"] is True, dead
    assert dead["reachable"] is False and dead["watch"]["live"] is False, dead
