"""Watches that cannot go blind (supervisor/rendezvous/etcd_watch.py), against real etcd:
a member without a leader refuses the stream, a member that stops answering is left for
another one without losing an event, and an outage makes the view re-read."""

from __future__ import annotations

import json
import signal
import time
import urllib.request

import anyio
import pytest

from supervisor.rendezvous.etcd_client import EtcdClient, EtcdUnavailable
from supervisor.rendezvous.etcd_watch import open_prefix_view
from tests.support.etcd import EtcdFactory, EtcdMember

pytestmark = pytest.mark.etcd


def has_leader(member: EtcdMember) -> bool:
    request = urllib.request.Request(member.endpoint + "/v3/maintenance/status", data=b"{}",
                                     method="POST")
    with urllib.request.urlopen(request, timeout=1) as resp:
        return int(json.load(resp).get("leader", 0)) != 0


def wait_leaderless(member: EtcdMember, timeout: float = 10) -> None:
    """Until the member says it has no leader (waiting for a server's state, as
    ``wait_healthy`` does)."""
    deadline = time.monotonic() + timeout
    while has_leader(member):
        assert time.monotonic() < deadline, f"{member.name} still has a leader"
        time.sleep(0.02)


def freeze(member: EtcdMember) -> None:
    assert member.process is not None
    member.process.send_signal(signal.SIGSTOP)


def thaw(member: EtcdMember) -> None:
    assert member.process is not None
    member.process.send_signal(signal.SIGCONT)


async def test_a_member_without_a_leader_refuses_the_watch_at_once(factory: EtcdFactory) -> None:
    """Without the leader header such a member accepts the watch and never feeds it (the
    issue's "opens and stays silent"); with it, etcd says "no leader" at once."""
    members = factory.cluster(3)
    freeze(members[1])
    freeze(members[2])
    try:
        wait_leaderless(members[0])
        async with EtcdClient([members[0].endpoint], timeout=2.0, retry_window=0) as client:
            # refused ("no leader"), not timed out (that would say TimeoutError)
            with anyio.fail_after(5), pytest.raises(EtcdUnavailable, match="no leader"):
                async with client.watch("/t/l/", prefix=True, start_revision=1) as watch:
                    await watch.__anext__()
    finally:
        thaw(members[1])
        thaw(members[2])


async def test_a_frozen_member_is_left_and_no_event_is_lost(factory: EtcdFactory) -> None:
    """The watch's member stops answering (SIGSTOP: its sockets stay open, nothing is
    refused): the watch leaves it within a few check intervals and resumes on another
    member from the last revision it delivered + 1."""
    members = factory.cluster(3)
    async with EtcdClient([m.endpoint for m in members], timeout=1.0) as client, \
            EtcdClient([members[1].endpoint], timeout=1.0, retry_window=10) as writer:
        # the writer waits out an election if the frozen member led the cluster
        start = await writer.put("/t/f/a", "1")
        async with client.watch("/t/f/", prefix=True, start_revision=start) as watch:
            with anyio.fail_after(5):
                first = await watch.__anext__()
            assert watch.endpoint == members[0].endpoint
            freeze(members[0])
            try:
                await writer.put("/t/f/b", "2")
                await writer.put("/t/f/c", "3")
                frozen_at = time.monotonic()
                # three check intervals (1 s each) and a probe's timeout, plus slack for
                # a loaded machine: it is ~3 s here
                with anyio.fail_after(10):
                    second = await watch.__anext__()
                moved_after = time.monotonic() - frozen_at
            finally:
                thaw(members[0])
            assert watch.endpoint != members[0].endpoint and watch.moves == 1
    keys = [ev.kv.key for ev in first + second]
    assert keys == ["/t/f/a", "/t/f/b", "/t/f/c"], keys
    assert moved_after < 10


async def test_after_an_outage_the_view_re_reads_and_watches_from_a_fresh_revision(
        factory: EtcdFactory) -> None:
    server = factory.single()
    async with EtcdClient([server.endpoint], timeout=0.5, retry_window=None) as client, \
            open_prefix_view(client, "/t/o/") as view:
        await client.put("/t/o/a", "1")
        with anyio.fail_after(5):
            await view.wait_revision(await client.put("/t/o/b", "2"))
        assert view.resyncs == 0 and view.watch_live
        freeze(server)
        try:
            with anyio.fail_after(10):
                while client.reachability.unreachable_since is None:  # the outage begins
                    with anyio.move_on_after(1):
                        await client.get("/t/o/a")
        finally:
            thaw(server)
        with anyio.fail_after(10):
            await client.get("/t/o/a")  # etcd answers again: the outage ends
            seen = view.version
            while view.resyncs == 0:
                await view.wait_changed(seen)
                seen = view.version
            revision = await client.put("/t/o/c", "3")
            await view.wait_revision(revision)
    assert set(view.kvs) == {"/t/o/a", "/t/o/b", "/t/o/c"}
    assert view.resyncs == 1
