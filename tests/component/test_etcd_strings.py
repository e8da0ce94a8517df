"""Strings from etcd pass ``rendezvous/etcd/wire/decode.py``'s rules before anything uses them
(issue 52, finding 7): a peer's health URL was any ``http...`` string (logged raw, fetched,
posted to with ``/leave-notice`` appended), node records' reasons were shown raw by
``node list``, and 20 records of 200 KB made every node's ``/status`` 4 MB.

Real etcd; the commands run as subprocesses.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import anyio
import msgspec
import pytest

from supervisor.core import nodehealth as nh
from supervisor.rendezvous.etcd.cutoff import CutoffCheck
from supervisor.rendezvous.etcd.keys import Keys
from supervisor.rendezvous.etcd.node_records import (
    MAX_SHOWN_NODES,
    EtcdNodeLedger,
    health_prefix,
)
from supervisor.rendezvous.etcd.summary import summary_prefix
from supervisor.rendezvous.etcd.wire.client import EtcdClient
from supervisor.rendezvous.etcd.wire.decode import health_url_host, peer_health_url
from tests.support.etcd import EtcdMember

pytestmark = pytest.mark.etcd

ESC = "\x1b"


@pytest.mark.parametrize("url", [
    "http://10.0.0.2:29480", "https://node-1.example:443", "http://[::1]:8080"])
def test_a_health_url_is_scheme_host_and_port(url: str) -> None:
    assert health_url_host(url) is not None


@pytest.mark.parametrize("url", [
    "http://10.0.0.2", "http://10.0.0.2:29480/", "http://10.0.0.2:29480/x",
    "http://10.0.0.2:29480?a=1", "http://10.0.0.2:29480#f", "http://u:p@10.0.0.2:1",
    "http://10.0.0.2:29480\nERROR job failed", "http://10.0.0.2:1\x1b[2J", "ftp://a:1",
    "http://10.0.0.2:99999", "http://a b:1", "http://" + "a" * 400 + ":1", "http://:1"])
def test_anything_else_is_no_health_url(url: str) -> None:
    assert health_url_host(url) is None


def test_a_peer_health_url_must_be_on_the_address_it_joined_with() -> None:
    assert peer_health_url("http://10.0.0.2:1", "10.0.0.2") == "http://10.0.0.2:1"
    assert peer_health_url("http://Node-1:1", "node-1") == "http://Node-1:1"
    assert peer_health_url("http://[::1]:1", "::1") == "http://[::1]:1"
    assert peer_health_url("http://169.254.169.254:80", "10.0.0.2") is None
    assert peer_health_url("http://10.0.0.2:1", None) is None


def summary(node: str, url: str) -> str:
    return json.dumps({"node_id": node, "health_url": url})


async def test_only_a_peers_plain_url_on_its_own_address_is_learnt(server: EtcdMember) -> None:
    run = "urls"
    peers = {"b": "http://127.0.0.1:4000/leave-notice?x=",  # a path: the blind POST
             "c": "http://127.0.0.1:4001\n2026-01-01 ERROR job failed",  # a forged log line
             "d": "http://10.9.9.9:4002",  # another host than it joined with
             "e": "http://127.0.0.1:4003"}  # fine
    async with EtcdClient([server.endpoint]) as client:
        for node, url in peers.items():
            await client.put(summary_prefix(run) + node, summary(node, url))
            await client.put(Keys(run).node(1, "join", node), json.dumps(
                {"node": node, "addr": "127.0.0.1", "local_world_size": 1}))
        learnt = {}
        for node in peers:
            check = CutoffCheck(client, run, "a", ttl=6.0, last_refresh_sent=time.monotonic,
                                on_cut_off=lambda reason: None)
            check.round_started(1, ["a", node])
            with anyio.fail_after(10):
                await check.learn_peers()
            learnt[node] = check.url(node)
    assert learnt == {"b": None, "c": None, "d": None, "e": "http://127.0.0.1:4003"}


def record(node: str, reason: str) -> bytes:
    return msgspec.json.encode(nh.NodeRecord(node, quarantined=nh.Quarantine(time.time(),
                                                                             reason)))


async def test_node_list_shows_no_escape_and_no_unbounded_record(server: EtcdMember) -> None:
    run = "nodes"
    prefix = health_prefix(Keys(run).prefix)
    async with EtcdClient([server.endpoint]) as client:
        await client.put(prefix + "escapes", record("escapes", f"gpu{ESC}]0;pwned\x07"))
        await client.put(prefix + "huge", record("huge", "x" * 200_000))
        await client.put(prefix + "fine", record("fine", "xid 79 on gpu 3"))
    listed = await anyio.to_thread.run_sync(lambda: subprocess.run(
        [sys.executable, "-m", "supervisor", "node", "list", "--rdzv-endpoint",
         server.endpoint, "--rdzv-id", run], capture_output=True, text=True, timeout=30))
    assert listed.returncode == 0, listed.stderr
    assert "fine: 0 failure(s) in the window; QUARANTINED: xid 79 on gpu 3" in listed.stdout
    assert ESC not in listed.stdout + listed.stderr and "\x07" not in listed.stdout
    assert "escapes" not in listed.stdout and "huge" not in listed.stdout  # not records


async def test_the_node_health_section_of_status_is_bounded_as_a_whole(
    server: EtcdMember,
) -> None:
    """The finding's 20 records of 200 KB, and more valid records than are shown."""
    run = "bounded"
    prefix = Keys(run).prefix
    async with EtcdClient([server.endpoint]) as client:
        for i in range(20):
            await client.put(health_prefix(prefix) + f"big{i}", record(f"big{i}", "x" * 200_000))
        for i in range(MAX_SHOWN_NODES + 8):
            await client.put(health_prefix(prefix) + f"n{i}", record(f"n{i}", "r" * 300))
        ledger = EtcdNodeLedger(client, prefix, "me", "me", nh.Limits())
        view = await ledger.job_view()
    shown = json.dumps(view)
    assert len(shown) < 64 << 10, len(shown)
    assert len(view["quarantined"]) == MAX_SHOWN_NODES
    assert not any(held["node"].startswith("big") for held in view["quarantined"])
    assert view["not_shown"] == 2 * 8
