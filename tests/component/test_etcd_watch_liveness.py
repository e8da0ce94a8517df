"""Watches that cannot go blind (supervisor/rendezvous/etcd/wire/watch.py), against real etcd:
a member without a leader refuses the stream; a member that stops answering delays no
event (the watch's second stream, on another member, delivers it) and its stream is
moved to another member, with no event lost or repeated; an outage makes the view
re-read."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import anyio
import anyio.lowlevel
import pytest

from supervisor.rendezvous.etcd.wire.client import EtcdClient, EtcdUnavailable
from supervisor.rendezvous.etcd.wire.watch import BACKLOG, LAG, Watch, open_prefix_view, open_watch
from tests.support.etcd import (
    EtcdFactory,
    EtcdMember,
    freeze,
    has_leader,
    is_leader,
    thaw,
)

pytestmark = pytest.mark.etcd


def wait_leaderless(member: EtcdMember, timeout: float = 10) -> None:
    """Until the member says it has no leader (waiting for a server's state, as
    ``wait_healthy`` does)."""
    deadline = time.monotonic() + timeout
    while has_leader(member):
        assert time.monotonic() < deadline, f"{member.name} still has a leader"
        time.sleep(0.02)


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
                async with open_watch(client, "/t/l/", prefix=True, start_revision=1) as watch:
                    await watch.__anext__()
    finally:
        thaw(members[1])
        thaw(members[2])


class StreamLog:
    """What a watch's ``on_live`` hook heard: wakes waiters when its streams' members
    change, so a test waits on the watch, never on a sleep."""

    def __init__(self) -> None:
        self.watch: Watch | None = None
        self._changed = anyio.Event()

    def heard(self, live: bool) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for(self, check: Callable[[tuple[str, ...]], bool]) -> None:
        assert self.watch is not None
        while not check(self.watch.endpoints):
            await self._changed.wait()


async def test_a_frozen_member_delays_no_event_and_its_stream_moves(
        factory: EtcdFactory) -> None:
    """The first stream's member stops answering (SIGSTOP: its sockets stay open, nothing
    is refused): the second stream, on another member, delivers a change at once; the
    frozen stream is moved within a few check intervals; each event comes once."""
    members = factory.cluster(3)
    streams = StreamLog()
    async with EtcdClient([m.endpoint for m in members], timeout=1.0) as client, \
            EtcdClient([members[1].endpoint], timeout=1.0, retry_window=10) as writer:
        # the writer waits out an election if the frozen member led the cluster
        start = await writer.put("/t/f/a", "1")
        async with open_watch(client, "/t/f/", prefix=True, start_revision=start,
                                on_live=streams.heard) as watch:
            streams.watch = watch
            with anyio.fail_after(5):
                first = await watch.__anext__()
                await streams.wait_for(lambda on: len(on) == 2)
            assert watch.endpoint == members[0].endpoint
            freeze(members[0])
            try:
                await writer.put("/t/f/b", "2")
                written_at = time.monotonic()
                with anyio.fail_after(5):
                    second = await watch.__anext__()
                delivered_after = time.monotonic() - written_at
                # three check intervals (1 s each) and a probe's timeout, plus slack for a
                # loaded machine: it is ~3 s here
                with anyio.fail_after(10):
                    await streams.wait_for(lambda on: len(on) == 2
                                           and members[0].endpoint not in on)
                await writer.put("/t/f/c", "3")
                with anyio.fail_after(5):
                    third = await watch.__anext__()
            finally:
                thaw(members[0])
            assert watch.moves == 1
    keys = [ev.kv.key for ev in first + second + third]
    assert keys == ["/t/f/a", "/t/f/b", "/t/f/c"], keys
    assert delivered_after < 1.0, delivered_after


@pytest.mark.xdist_group("load")  # a bound on when the quiet stream moves
async def test_a_stream_behind_the_other_moves_and_requests_follow_the_news(
        factory: EtcdFactory, caplog: pytest.LogCaptureFixture) -> None:
    """A follower's stream goes silent (SIGSTOP) while no request of the client fails
    there: the other stream brings the next change, the client's requests now go to that
    stream's member (no hedge to wait out on the frozen one), and the silent stream leaves
    ``LAG`` s after the news because it did not bring that revision, not at its next quiet
    check (the interval here is 8 s, so that a move within it can only be this one) and
    not only after two intervals without an answer and a probe's timeout."""
    interval = 8.0
    members = factory.cluster(3)
    frozen = next(m for m in members if not is_leader(m))
    ordered = [frozen, *(m for m in members if m is not frozen)]
    streams = StreamLog()
    async with EtcdClient([m.endpoint for m in ordered], timeout=2.0) as client, \
            EtcdClient([ordered[1].endpoint], timeout=2.0, retry_window=10) as writer:
        start = await writer.put("/t/n/a", "1")
        async with open_watch(client, "/t/n/", prefix=True, start_revision=start,
                                on_live=streams.heard, check_interval=interval) as watch:
            streams.watch = watch
            with anyio.fail_after(5):
                await watch.__anext__()
                await streams.wait_for(lambda on: len(on) == 2)
            assert watch.endpoint == frozen.endpoint
            freeze(frozen)
            try:
                # the writer waits out an election if the frozen member has become leader
                await writer.put("/t/n/b", "2")
                with anyio.fail_after(10):
                    await watch.__anext__()
                news_at = time.monotonic()
                # the member whose stream brought it
                assert client.preferred != frozen.endpoint
                assert client.preferred in watch.endpoints
                with anyio.fail_after(interval):
                    await streams.wait_for(lambda on: len(on) == 2
                                           and frozen.endpoint not in on)
                moved_after = time.monotonic() - news_at
            finally:
                thaw(frozen)
            assert watch.moves == 1
    leaves = [r.getMessage() for r in caplog.records if "etcd watch leaves" in r.getMessage()]
    # (revision start + 1, or + 2 if the writer's put was applied twice across an election)
    assert len(leaves) == 1, leaves
    assert re.fullmatch(rf"etcd watch leaves {re.escape(frozen.endpoint)}: another member "
                        rf"delivered revision \d+, it did not in {LAG:g}s", leaves[0]), leaves
    # LAG (0.5 s) and a connect, with slack for a starved machine; the quiet check would
    # have come up to 8 s after the freeze
    assert moved_after < interval / 2, moved_after


async def test_between_healthy_members_requests_return_to_the_first_streams_member(
        factory: EtcdFactory) -> None:
    """Whichever stream brings a change first, once the first stream's member has brought
    it too (the copy is counted as a duplicate), requests go to that member again: the
    preference follows the news only while one member is ahead."""
    members = factory.cluster(3)
    streams = StreamLog()
    async with EtcdClient([m.endpoint for m in members], timeout=2.0) as client, \
            EtcdClient([members[1].endpoint], timeout=2.0) as writer:
        start = await writer.put("/t/c/0", "0")
        async with open_watch(client, "/t/c/", prefix=True, start_revision=start,
                                on_live=streams.heard) as watch, \
                anyio.create_task_group() as tg:
            streams.watch = watch
            delivered: list[str] = []

            async def read() -> None:
                async for events in watch:
                    delivered.extend(ev.kv.key for ev in events)

            tg.start_soon(read)
            with anyio.fail_after(5):
                await streams.wait_for(lambda on: len(on) == 2)
            first = watch.endpoints[0]
            for n in range(6):
                if n:
                    await writer.put(f"/t/c/{n}", str(n))
                # both streams bring every revision: the news, then its copy (counted as
                # a duplicate), milliseconds apart. Wait for revision n's copy, not for
                # any copy: a stream that opened a little later brought /t/c/0's copy
                # after /t/c/1 was put, and the check then ran between /t/c/1's news
                # and its copy
                with anyio.fail_after(5):
                    while client.stats.watch_duplicates < n + 1:
                        await anyio.lowlevel.checkpoint()
                assert client.preferred == first, n
            tg.cancel_scope.cancel()
    assert delivered == [f"/t/c/{n}" for n in range(6)], delivered


async def test_a_reader_slower_than_the_writes_moves_no_stream(factory: EtcdFactory) -> None:
    """A reader busy elsewhere during a burst of writes and for twice ``LAG`` after it (the
    backlog fills, and both streams wait to hand over what they read) is not a member
    going quiet: a stream that is behind its sibling only because it waited on the reader
    catches up as soon as it reads again, so no stream moves, and every event comes once,
    in order."""
    members = factory.cluster(3)
    writes = BACKLOG + 30
    async with EtcdClient([m.endpoint for m in members], timeout=1.0) as client, \
            EtcdClient([members[1].endpoint], timeout=1.0, retry_window=10) as writer:
        start = await writer.put("/t/s/000", "x")
        async with open_watch(client, "/t/s/", prefix=True, start_revision=start) as watch:
            last = start
            for n in range(1, writes):  # the reader reads nothing meanwhile
                last = await writer.put(f"/t/s/{n:03}", "x")
            # the burst takes ~0.3 s here; the reader stays away longer than a stream may
            # be behind (the case under test, not a wait for something to happen)
            await anyio.sleep(2 * LAG)
            revisions: list[int] = []
            with anyio.fail_after(60):
                while not revisions or revisions[-1] < last:
                    revisions.extend(ev.kv.mod_revision for ev in await watch.__anext__())
            assert watch.moves == 0
    assert revisions == list(range(start, last + 1)), revisions


async def test_no_event_is_lost_or_repeated_while_a_stream_moves(factory: EtcdFactory) -> None:
    """Writes before, during and after a member is frozen and its stream moved (resuming
    from the last delivered revision + 1) arrive exactly once, in revision order: only
    this test writes to the cluster, so every revision from the first write to the last
    is one event. (The writer may apply a put twice when it retries across an election:
    that is two revisions, two events.)"""
    members = factory.cluster(3)
    streams = StreamLog()
    revisions: list[int] = []
    last = 0
    all_seen = anyio.Event()

    async def collect(watch: Watch) -> None:
        async for events in watch:
            revisions.extend(ev.kv.mod_revision for ev in events)
            if last and revisions[-1] >= last:
                all_seen.set()

    async with EtcdClient([m.endpoint for m in members], timeout=1.0) as client, \
            EtcdClient([members[1].endpoint], timeout=1.0, retry_window=10) as writer:
        start = await writer.put("/t/n/000", "x")
        async with open_watch(client, "/t/n/", prefix=True, start_revision=start,
                                on_live=streams.heard) as watch, \
                anyio.create_task_group() as tg:
            streams.watch = watch
            tg.start_soon(collect, watch)
            with anyio.fail_after(20):
                await streams.wait_for(lambda on: len(on) == 2)
                for i in range(1, 10):
                    await writer.put(f"/t/n/{i:03}", "x")
                freeze(members[0])
                try:
                    for i in range(10, 20):
                        await writer.put(f"/t/n/{i:03}", "x")
                    await streams.wait_for(lambda on: len(on) == 2
                                           and members[0].endpoint not in on)
                finally:
                    thaw(members[0])
                for i in range(20, 29):
                    await writer.put(f"/t/n/{i:03}", "x")
                last = await writer.put("/t/n/029", "x")
                if revisions and revisions[-1] >= last:
                    all_seen.set()
                await all_seen.wait()
            tg.cancel_scope.cancel()
    assert revisions == list(range(start, last + 1)), revisions
    assert watch.moves == 1
    assert client.stats.watch_events == len(revisions)


async def test_a_watch_with_one_endpoint_opens_one_stream(factory: EtcdFactory) -> None:
    server = factory.single()
    async with EtcdClient([server.endpoint], timeout=1.0) as client:
        start = await client.put("/t/one/a", "1")
        async with open_watch(client, "/t/one/", prefix=True, start_revision=start) as watch:
            with anyio.fail_after(5):
                await watch.__anext__()
            assert watch.endpoints == (server.endpoint,)
    assert client.stats.watches_opened == 1 and client.stats.watch_duplicates == 0


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
