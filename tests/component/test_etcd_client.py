"""The etcd JSON-gateway client against a real etcd."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from supervisor.rendezvous.etcd.lease import LeaseKeeper
from supervisor.rendezvous.etcd.wire.client import (
    EtcdClient,
    EtcdError,
    EtcdLeaseNotFound,
    EtcdUnavailable,
    TlsFiles,
    compare,
    delete_op,
    put_op,
    range_op,
)
from supervisor.rendezvous.etcd.wire.watch import open_prefix_view, open_watch
from tests.support.etcd import (
    EtcdFactory,
    EtcdMember,
    freeze,
    is_leader,
    make_tls_material,
    member_status,
    thaw,
)
from tests.support.ports import free_port

pytestmark = pytest.mark.etcd


@pytest.fixture
async def client(server: EtcdMember) -> AsyncIterator[EtcdClient]:
    async with EtcdClient([server.endpoint], timeout=2.0) as client:
        yield client


async def test_put_get_delete_roundtrip(client: EtcdClient) -> None:
    revision = await client.put("/t/a", "héllo")
    kv = await client.get("/t/a")
    assert kv is not None
    assert (kv.text, kv.mod_revision, kv.version) == ("héllo", revision, 1)
    assert await client.delete("/t/a") == 1
    assert await client.get("/t/a") is None


async def test_range_prefix_returns_only_keys_under_it(client: EtcdClient) -> None:
    for key in ("/t/a", "/t/b", "/t0", "/u"):
        await client.put(key, "x")
    result = await client.range("/t/", prefix=True)
    assert [kv.key for kv in result.kvs] == ["/t/a", "/t/b"]


async def test_txn_put_if_absent_succeeds_once(client: EtcdClient) -> None:
    create = ([compare("/t/k", "VERSION", "=", 0)], [put_op("/t/k", "first")])
    assert (await client.txn(*create)).succeeded
    second = await client.txn(*create, failure=[range_op("/t/k")])
    assert not second.succeeded
    kvs = second.responses[0]["response_range"]["kvs"]
    assert len(kvs) == 1


async def test_txn_range_compare_sees_any_newer_key(client: EtcdClient) -> None:
    revision = await client.put("/t/p/a", "1")
    guard = compare("/t/p/", "MOD", "<", revision + 1, prefix=True)
    assert (await client.txn([guard], [put_op("/t/ok", "1")])).succeeded
    await client.put("/t/p/b", "1")
    assert not (await client.txn([guard], [delete_op("/t/p/", prefix=True)])).succeeded


async def test_lease_keys_vanish_on_revoke(client: EtcdClient) -> None:
    lease, ttl = await client.lease_grant(30)
    assert ttl == 30
    await client.put("/t/leased", "v", lease=lease)
    assert await client.lease_keepalive(lease) == 30
    await client.lease_revoke(lease)
    assert await client.get("/t/leased") is None
    with pytest.raises(EtcdLeaseNotFound):
        await client.lease_keepalive(lease)


async def test_watch_yields_puts_and_deletes_in_order(client: EtcdClient) -> None:
    start = await client.put("/t/w/a", "1")
    await client.delete("/t/w/a")
    await client.put("/t/other", "ignored")
    seen: list[tuple[str, str]] = []
    with anyio.fail_after(5):
        async with open_watch(client, "/t/w/", prefix=True, start_revision=start) as watch:
            async for events in watch:
                seen += [(ev.type, ev.kv.key) for ev in events]
                if len(seen) >= 2:
                    break
    assert seen == [("PUT", "/t/w/a"), ("DELETE", "/t/w/a")]


async def test_prefix_view_follows_changes(client: EtcdClient) -> None:
    await client.put("/t/v/a", "1")
    with anyio.fail_after(5):
        async with open_prefix_view(client, "/t/v/") as view:
            assert set(view.kvs) == {"/t/v/a"}
            await client.put("/t/v/b", "2")
            while "/t/v/b" not in view.kvs:
                await view.wait_changed()
            await client.delete("/t/v/a")
            while "/t/v/a" in view.kvs:
                await view.wait_changed()
    assert set(view.kvs) == {"/t/v/b"}


async def test_failover_skips_a_dead_first_endpoint(server: EtcdMember) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with EtcdClient([dead, server.endpoint], timeout=2.0) as client:
        with anyio.fail_after(5):
            await client.put("/t/f", "1")
            assert await client.get("/t/f") is not None
        assert client.endpoints[client._current] == server.endpoint


async def test_cluster_survives_loss_of_the_member_in_use(factory: EtcdFactory) -> None:
    members = factory.cluster(3)
    async with EtcdClient([m.endpoint for m in members], timeout=2.0) as client:
        await client.put("/t/c", "1")
        members[0].kill()
        with anyio.fail_after(10):
            await client.put("/t/c", "2")
            kv = await client.get("/t/c")
        assert kv is not None and kv.text == "2"


async def test_watch_resumes_on_another_member(factory: EtcdFactory) -> None:
    members = factory.cluster(3)
    async with EtcdClient([m.endpoint for m in members], timeout=2.0) as client:
        start = await client.put("/t/r/a", "1")
        with anyio.fail_after(10):
            async with open_watch(client, "/t/r/", prefix=True, start_revision=start) as watch:
                first = await watch.__anext__()
                members[0].kill()
                await client.put("/t/r/b", "2")
                second = await watch.__anext__()
    assert [ev.kv.key for ev in first + second] == ["/t/r/a", "/t/r/b"]


async def test_the_leaves_revoke_commits_as_soon_as_a_new_leader_is_elected(
        factory: EtcdFactory) -> None:
    """The leave's revoke made right after the raft leader went silent (frozen: its
    traffic unanswered, no error): the others drop every proposal until they have elected
    a new leader, so the revoke must be asked again promptly then, not after a growing
    backoff (which took it up to 1 s past the election). etcd's default election timeout
    (1 s, randomised up to 2 s): the election comes 1-2 s after the freeze."""
    members = factory.cluster(3, election_ms=1000)
    leader = next(m for m in members if is_leader(m))
    others = [m for m in members if m is not leader]
    old = str(member_status(leader).get("leader"))
    elected: list[float] = []

    def new_leader() -> bool:
        for member in others:
            with contextlib.suppress(OSError):
                if str(member_status(member).get("leader", 0)) not in ("0", old):
                    return True
        return False

    async def watch_election() -> None:
        # asked back to back (each answer takes milliseconds): the election's time
        while not await anyio.to_thread.run_sync(new_leader):
            pass
        elected.append(time.monotonic())

    async def never(_: bool) -> None:
        raise AssertionError("the lease was not replaced")

    async with EtcdClient([m.endpoint for m in [leader, *others]], timeout=3.0,
                          hedge_after=0.2) as client:
        keeper = LeaseKeeper(client, 30, never)
        await keeper.grant()
        await client.put("/t/leave/key", "1", lease=keeper.id)
        freeze(leader)
        try:
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:  # ends once the election seen
                    tg.start_soon(watch_election)
                    await keeper.revoke()
                    revoked = time.monotonic()
            assert await client.get("/t/leave/key") is None
        finally:
            thaw(leader)
    # the first round asked after the election commits: REVOKE_EVERY (0.1 s) and a commit
    assert revoked - elected[0] < 0.4, (revoked - elected[0])


async def test_a_hedged_call_does_not_wait_on_a_silent_member(factory: EtcdFactory) -> None:
    """The leave's revoke with the first endpoint frozen (a follower, so no election
    interferes): the next member is asked after ``hedge_after``, not after the 3 s
    timeout, and the lease's keys are gone."""
    members = factory.cluster(3)
    silent = next(m for m in members if not is_leader(m))
    ordered = [silent, *(m for m in members if m is not silent)]
    async with EtcdClient([m.endpoint for m in ordered], timeout=3.0,
                          hedge_after=0.2) as client:
        lease, _ = await client.lease_grant(30)
        await client.put("/t/h/key", "1", lease=lease)
        freeze(silent)
        try:
            started = time.monotonic()
            # a loaded machine can make a healthy member slower than the hedge too: then
            # a later ask may answer "not found" for the lease an earlier one revoked (the
            # leave counts that as revoked, lease.LeaseKeeper.revoke); a CI run saw it
            with anyio.fail_after(5), contextlib.suppress(EtcdLeaseNotFound):
                await client.lease_revoke(lease)
            took = time.monotonic() - started
            assert await client.get("/t/h/key") is None
        finally:
            thaw(silent)
    assert took < 1.0, took


async def test_a_hedged_call_takes_a_refusal_as_the_answer(factory: EtcdFactory) -> None:
    """A member's "lease not found" ends the call (no other member is asked for it):
    the leave counts a lease already gone as revoked."""
    members = factory.cluster(3)
    async with EtcdClient([m.endpoint for m in members], timeout=3.0,
                          hedge_after=0.2) as client:
        with anyio.fail_after(5), pytest.raises(EtcdLeaseNotFound):
            await client.lease_revoke(0x5EED)
        assert client.stats.failed_attempts == 0


async def test_unreachable_endpoints_raise_unavailable_naming_them() -> None:
    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    async with EtcdClient(dead, timeout=1.0) as client:
        with anyio.fail_after(5), pytest.raises(EtcdUnavailable) as info:
            await client.get("/t")
    assert dead[0] in str(info.value) and dead[1] in str(info.value)


async def test_user_password_authenticates_without_leaking_it(server: EtcdMember) -> None:
    ctl = ["etcdctl", "--endpoints", server.endpoint]
    subprocess.run([*ctl, "user", "add", "root:s3cret-pw"], check=True, capture_output=True)
    subprocess.run([*ctl, "auth", "enable"], check=True, capture_output=True)
    async with EtcdClient([server.endpoint], user="root", password="s3cret-pw") as client:
        await client.put("/t/auth", "1")
        assert "s3cret-pw" not in repr(client)
    async with EtcdClient([server.endpoint], user="root", password="wrong") as client:
        with pytest.raises(EtcdError, match="authentication failed") as info:
            await client.get("/t/auth")
    assert "wrong" not in str(info.value)


async def test_tls_with_client_certificate(factory: EtcdFactory, tmp_path: Path) -> None:
    material = make_tls_material(tmp_path / "tls")
    server = factory.single(tls=material)
    tls = TlsFiles(str(material.ca), str(material.client_cert), str(material.client_key))
    async with EtcdClient([server.endpoint], tls=tls) as client:
        await client.put("/t/tls", "1")
        assert await client.get("/t/tls") is not None


async def test_stats_count_requests_conflicts_and_watch_events(client: EtcdClient) -> None:
    start = await client.put("/t/s/a", "1")
    assert not (await client.txn([compare("/t/s/a", "VERSION", "=", 0)], [])).succeeded
    with anyio.fail_after(5):
        async with open_watch(client, "/t/s/", prefix=True, start_revision=start) as watch:
            await watch.__anext__()
    stats = client.stats.as_dict()
    assert stats["requests"] == 2 and stats["txns"] == 1 and stats["txn_conflicts"] == 1
    assert stats["watches_opened"] == 1 and stats["watch_events"] == 1
    assert stats["watch_bytes"] == 1 and stats["path:/v3/kv/txn"] == 1


async def test_unlimited_retry_waits_out_an_outage_and_reports_it_once(
        server: EtcdMember) -> None:
    changes: list[bool] = []
    down = anyio.Event()

    def heard(up: bool, _: object) -> None:
        changes.append(up)
        if not up:
            down.set()

    async with EtcdClient([server.endpoint], timeout=1.0, retry_window=None,
                          on_reachability=heard) as client:
        await client.put("/t/o", "1")
        server.kill()
        got: list[object] = []
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                async def read() -> None:
                    got.append(await client.get("/t/o"))

                tg.start_soon(read)
                await down.wait()  # a whole pass over the endpoints failed
                await anyio.to_thread.run_sync(server.start)
                await anyio.to_thread.run_sync(server.wait_healthy)
        r = client.reachability
    assert changes == [False, True] and r.outages == 1 and r.last_outage > 0
    assert len(got) == 1 and got[0] is not None
