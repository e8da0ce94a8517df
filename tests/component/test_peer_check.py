"""The lost-peer check of the etcd backends (``etcd.peers.check_peers``) against a real
etcd and real sockets: a health endpoint that refuses (gone), one that answers (alive), one
that accepts and never answers (unsure, within the bound), and an answering peer whose join
key is gone with its lease (gone)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
from aiohttp import web

from supervisor.core.peers import CHECK_BOUND, LostPeer
from supervisor.rendezvous.base import RendezvousResult
from supervisor.rendezvous.etcd.cutoff import CutoffCheck
from supervisor.rendezvous.etcd.keys import Keys
from supervisor.rendezvous.etcd.peers import check_peers
from supervisor.rendezvous.etcd.summary import summary_prefix
from supervisor.rendezvous.etcd.wire.client import EtcdClient
from tests.support.etcd import EtcdMember

pytestmark = pytest.mark.etcd

RUN = "peer-check"
ROUND = 3


@asynccontextmanager
async def status_server(run_id: str) -> AsyncIterator[str]:
    """A health endpoint whose /status is a document of job ``run_id``."""

    async def status(_request: web.Request) -> web.Response:
        return web.json_response({"run_id": run_id, "state": "running"})

    app = web.Application()
    app.router.add_get("/status", status)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    sock = socket.create_server(("127.0.0.1", 0))
    site = web.SockSite(runner, sock)
    await site.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        with anyio.CancelScope(shield=True):
            await runner.cleanup()


def summary(node: str, url: str) -> str:
    """A node's status summary naming its health URL."""
    return json.dumps({"node_id": node, "health_url": url})


def join(node: str, addr: str = "127.0.0.1") -> str:
    """A node's join key of the round, on ``addr`` (the address a health URL must be on to
    be asked)."""
    return json.dumps({"node": node, "addr": addr, "local_world_size": 1})


def closed_port() -> str:
    """A URL on a port nobody listens on (bound, then closed: refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


async def test_refused_and_lease_gone_are_lost_a_silent_peer_is_not(
        server: EtcdMember) -> None:
    keys = Keys(RUN)
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never answers
    try:
        async with EtcdClient([server.endpoint]) as client, status_server(RUN) as alive:
            urls = {"b": closed_port(), "c": alive, "d": f"http://127.0.0.1:"
                    f"{silent.getsockname()[1]}", "e": alive, "f": closed_port()}
            for node, url in urls.items():
                await client.put(summary_prefix(RUN) + node, summary(node, url))
            for node in ("a", "b", "c", "d"):  # e's join key went with its lease
                await client.put(keys.node(ROUND, "join", node), join(node))
            # f's summary names a URL on another host than it joined with: never asked
            await client.put(keys.node(ROUND, "join", "f"), join("f", "10.9.9.9"))
            peers = CutoffCheck(client, RUN, "a", ttl=10, last_refresh_sent=time.monotonic,
                                on_cut_off=lambda _reason: None)
            result = RendezvousResult(ROUND, 0, 6, 0, 6, "127.0.0.1", 1,
                                      members=("a", "b", "c", "d", "e", "f"))
            started = time.monotonic()
            check = await check_peers(client, keys, peers, RUN, "a", result, CHECK_BOUND)
            took = time.monotonic() - started
    finally:
        silent.close()
    assert check.lost == (
        LostPeer("b", f"its health endpoint at {urls['b']} refused the connection"),
        LostPeer("e", "its lease is gone"))
    assert check.alive == ("c",) and check.unsure == ("d", "f")
    assert took <= CHECK_BOUND + 0.5, took  # bounded: the silent peer does not hold it up


async def test_without_etcd_the_health_endpoints_alone_tell(server: EtcdMember) -> None:
    """A c10d host's etcd dies with it: the URLs known from before still tell."""
    keys = Keys(RUN)
    async with EtcdClient([server.endpoint]) as client:
        gone = closed_port()
        await client.put(summary_prefix(RUN) + "b", summary("b", gone))
        await client.put(keys.node(ROUND, "join", "b"), join("b"))
        peers = CutoffCheck(client, RUN, "a", ttl=10, last_refresh_sent=time.monotonic,
                            on_cut_off=lambda _reason: None)
        await peers.learn_all(["a", "b"], ROUND)
    async with EtcdClient([closed_port()]) as dead:  # etcd gone
        result = RendezvousResult(ROUND, 0, 2, 0, 2, "127.0.0.1", 1, members=("a", "b"))
        check = await check_peers(dead, keys, peers, RUN, "a", result, CHECK_BOUND)
    assert [p.node for p in check.lost] == ["b"]
