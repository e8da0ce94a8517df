"""Buddy copies over real TCP: a sender and a buddy's server in one test, each with its own
regions of shared memory and slot table; peers that cannot prove they belong, transfers
cut in the middle, copies that do not fit, a buddy that stalls."""

from __future__ import annotations

import os
import socket
import ssl
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
from anyio.streams.text import TextReceiveStream

from supervisor.core.slots import SlotTable
from supervisor.snapshots.memory import Regions
from supervisor.snapshots.replicate.auth import HELLO, NONCE, Auth, PeerTls
from supervisor.snapshots.replicate.fetch import fetch
from supervisor.snapshots.replicate.receive import BuddyReceiver
from supervisor.snapshots.replicate.send import BuddySender
from supervisor.snapshots.replicate.wire import (
    Answer,
    AuthRefused,
    Cut,
    Fetch,
    Push,
    RankCopy,
    Refused,
    ReplicaCounts,
    mac,
    read_frame,
    send_frame,
)
from tests.support.etcd import make_tls_material
from tests.support.paths import WORKERS
from tests.support.ports import free_port
from tests.support.snapshotbytes import save_step
from tests.support.tmpfs import small_tmpfs
from tests.support.waiting import until

SECRET = b"the job's secret, 32 bytes long!"
WORLD = 4
RANKS = frozenset({2, 3})  # the sending node's global ranks
MIB = 1 << 20


@dataclass
class Node:
    """A sending node: its regions, slot table and sender."""

    regions: Regions
    table: SlotTable
    sender: BuddySender

    def save(self, rank: int, step: int, nbytes: int = MIB) -> None:
        save_step(self.table, self.regions, rank, step, nbytes)

    def save_all(self, step: int, nbytes: int = MIB) -> None:
        for rank in sorted(RANKS):
            self.save(rank, step, nbytes)

    def region_bytes(self, rank: int, step: int) -> bytes:
        slot = next(s for s in self.table.complete() if s.key == rank and s.step == step)
        return self.regions.path(slot).read_bytes()[:slot.size]


def make_node(base: Path, auth: Auth, **kwargs: object) -> Node:
    base.mkdir(exist_ok=True)
    regions = Regions.create(base)
    table = SlotTable()
    table.decide(WORLD)
    sender = BuddySender(table, regions.open_read, auth, "node-a", **kwargs)  # type: ignore[arg-type]
    return Node(regions, table, sender)


@asynccontextmanager
async def buddy(base: Path, auth: Auth, **kwargs: object) -> AsyncIterator[BuddyReceiver]:
    """A buddy's server on a loopback port of its own, serving until the block ends."""
    base.mkdir(exist_ok=True)
    regions = Regions.create(base)
    kwargs.setdefault("port", 0)
    kwargs.setdefault("host", "127.0.0.1")
    receiver = BuddyReceiver(regions, auth, **kwargs)  # type: ignore[arg-type]
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(receiver.run)
            yield receiver
            tg.cancel_scope.cancel()
    finally:
        regions.close()


def kept_bytes(receiver: BuddyReceiver, node: str, rank: int) -> bytes:
    held = receiver.held[node].ranks[rank]
    return (receiver.regions.directory / held.region).read_bytes()[:held.size]


def region_files(receiver: BuddyReceiver) -> set[str]:
    return set(os.listdir(receiver.regions.directory))


def aim(node: Node, receiver: BuddyReceiver) -> None:
    node.sender.aim(("127.0.0.1", receiver.port), RANKS, WORLD)


# ---------------------------------------------------------------------------- copies
async def test_a_step_reaches_the_buddy_bit_for_bit(tmp_path: Path) -> None:
    auth = Auth(secret=SECRET)
    node = make_node(tmp_path / "a", auth)
    node.save_all(3)
    async with buddy(tmp_path / "b", auth) as receiver:
        aim(node, receiver)
        assert await node.sender.send_newest() == 3
        assert receiver.held["node-a"].step == 3
        for rank in RANKS:
            assert kept_bytes(receiver, "node-a", rank) == node.region_bytes(rank, 3)
        sent = sum(len(node.region_bytes(rank, 3)) for rank in RANKS)
        assert node.sender.counts.bytes_sent == receiver.counts.bytes_received == sent
        assert (node.sender.counts.copies_sent, receiver.counts.copies_received) == (1, 1)
        assert node.table.readers == {}  # the slots are unpinned once sent
        assert await node.sender.send_newest() is None  # the buddy has it already


async def test_a_copy_crosses_ipv6(tmp_path: Path) -> None:
    if not socket.has_ipv6:
        pytest.skip("this Python has no IPv6")
    auth = Auth(secret=SECRET)
    node = make_node(tmp_path / "a", auth)
    node.save_all(3)
    async with buddy(tmp_path / "b", auth, host="::1") as receiver:
        node.sender.aim(("::1", receiver.port), RANKS, WORLD)
        assert await node.sender.send_newest() == 3


async def test_a_newer_step_replaces_the_older_copy(tmp_path: Path) -> None:
    auth = Auth(secret=SECRET)
    node = make_node(tmp_path / "a", auth)
    async with buddy(tmp_path / "b", auth) as receiver:
        aim(node, receiver)
        node.save_all(3)
        await node.sender.send_newest()
        first = region_files(receiver)
        node.save_all(4)
        assert await node.sender.send_newest() == 4
        assert receiver.held["node-a"].step == 4
        assert kept_bytes(receiver, "node-a", 2) == node.region_bytes(2, 4)
        assert not first & region_files(receiver)  # the older copy's regions are freed
        assert len(region_files(receiver)) == len(RANKS)


async def test_the_sender_task_sends_each_newer_step_when_woken(tmp_path: Path) -> None:
    auth = Auth(secret=SECRET)
    node = make_node(tmp_path / "a", auth)
    async with buddy(tmp_path / "b", auth) as receiver, anyio.create_task_group() as tg:
        await tg.start(node.sender.run)
        node.save_all(1)
        aim(node, receiver)
        await until(lambda: "node-a" in receiver.held)
        node.save_all(2)
        node.sender.wake()
        await until(lambda: node.sender.status()["sent_step"] == 2)
        assert receiver.held["node-a"].step == 2
        tg.cancel_scope.cancel()


async def test_a_buddy_that_comes_back_gets_the_copy(tmp_path: Path) -> None:
    auth = Auth(secret=SECRET)
    node = make_node(tmp_path / "a", auth, retry=(0.05, 0.2))
    node.save_all(3)
    port = free_port()  # nothing listens there yet: the buddy's supervisor is down
    async with anyio.create_task_group() as tg:
        await tg.start(node.sender.run)
        node.sender.aim(("127.0.0.1", port), RANKS, WORLD)
        await until(lambda: node.sender.counts.transfers_failed >= 2)  # retried
        node.save_all(4)
        node.sender.wake()
        async with buddy(tmp_path / "b", auth, port=port) as receiver:
            await until(lambda: node.sender.status()["sent_step"] == 4)
            assert receiver.held["node-a"].step == 4  # the newest step, not the failed one
        tg.cancel_scope.cancel()


# ---------------------------------------------------------------------------- who belongs
async def test_a_sender_with_a_wrong_secret_gets_nothing_and_is_counted(tmp_path: Path) -> None:
    node = make_node(tmp_path / "a", Auth(secret=b"another job's secret"))
    node.save_all(3)
    async with buddy(tmp_path / "b", Auth(secret=SECRET)) as receiver:
        aim(node, receiver)
        assert await node.sender.send_newest() is None
        await until(lambda: receiver.counts.auth_refused == 1)
        assert receiver.held == {} and receiver.counts.bytes_received == 0
        assert region_files(receiver) == set()
        assert node.sender.counts.transfers_failed == 1


async def test_a_peer_that_proves_nothing_receives_nothing(tmp_path: Path) -> None:
    async with buddy(tmp_path / "b", Auth(secret=SECRET)) as receiver:

        def probe() -> bytes:
            with socket.create_connection(("127.0.0.1", receiver.port), timeout=10) as sock:
                hello = sock.recv(len(HELLO) + NONCE, socket.MSG_WAITALL)
                sock.sendall(os.urandom(NONCE + 32))  # a nonce and a guessed proof
                rest = b""
                while chunk := sock.recv(4096):
                    rest += chunk
                return hello + rest

        got = await anyio.to_thread.run_sync(probe)
        assert got.startswith(HELLO) and len(got) == len(HELLO) + NONCE  # the challenge only
        await until(lambda: receiver.counts.auth_refused == 1)


async def test_a_buddy_that_proves_nothing_is_sent_nothing(tmp_path: Path) -> None:
    node = make_node(tmp_path / "a", Auth(secret=SECRET))
    node.save_all(3)
    listener = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []

    def impostor() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(HELLO + os.urandom(NONCE))
            conn.recv(NONCE + 32, socket.MSG_WAITALL)
            conn.sendall(os.urandom(32))  # a proof of a secret it does not know
            received.append(b"")
            while chunk := conn.recv(65536):
                received.append(chunk)

    with listener:
        node.sender.aim(("127.0.0.1", listener.getsockname()[1]), RANKS, WORLD)
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, impostor)
            assert await node.sender.send_newest() is None
    assert b"".join(received) == b""  # not one byte after the handshake
    assert (node.sender.counts.auth_refused, node.sender.counts.bytes_sent) == (1, 0)


async def test_mutual_tls_carries_a_copy(tmp_path: Path) -> None:
    tls = make_tls_material(tmp_path / "tls")
    node = make_node(tmp_path / "a", Auth(tls=PeerTls(str(tls.ca), str(tls.client_cert),
                                                      str(tls.client_key))))
    node.save_all(5)
    server_auth = Auth(tls=PeerTls(str(tls.ca), str(tls.server_cert), str(tls.server_key)))
    async with buddy(tmp_path / "b", server_auth) as receiver:
        aim(node, receiver)
        assert await node.sender.send_newest() == 5
        assert kept_bytes(receiver, "node-a", 3) == node.region_bytes(3, 5)


async def test_a_tls_peer_without_a_client_certificate_is_refused(tmp_path: Path) -> None:
    tls = make_tls_material(tmp_path / "tls")
    server_auth = Auth(tls=PeerTls(str(tls.ca), str(tls.server_cert), str(tls.server_key)))
    async with buddy(tmp_path / "b", server_auth) as receiver:

        def probe() -> bytes:
            context = ssl.create_default_context(cafile=str(tls.ca))
            context.check_hostname = False
            with socket.create_connection(("127.0.0.1", receiver.port), timeout=10) as raw:
                try:
                    with context.wrap_socket(raw) as sock:
                        return sock.recv(4096)
                except (ssl.SSLError, OSError):
                    return b""

        assert await anyio.to_thread.run_sync(probe) == b""
        await until(lambda: receiver.counts.auth_refused == 1)
        assert receiver.held == {}


async def test_a_certificate_of_another_ca_is_refused(tmp_path: Path) -> None:
    ours, theirs = make_tls_material(tmp_path / "ours"), make_tls_material(tmp_path / "theirs")
    stranger = Auth(tls=PeerTls(str(ours.ca), str(theirs.client_cert), str(theirs.client_key)))
    node = make_node(tmp_path / "a", stranger)
    node.save_all(3)
    server_auth = Auth(tls=PeerTls(str(ours.ca), str(ours.server_cert), str(ours.server_key)))
    async with buddy(tmp_path / "b", server_auth) as receiver:
        aim(node, receiver)
        assert await node.sender.send_newest() is None
        await until(lambda: receiver.counts.auth_refused == 1)
        assert receiver.held == {} and receiver.counts.bytes_received == 0


async def test_a_secret_sender_cannot_reach_a_tls_buddy(tmp_path: Path) -> None:
    tls = make_tls_material(tmp_path / "tls")
    node = make_node(tmp_path / "a", Auth(secret=SECRET), io_timeout=5.0)
    node.save_all(3)
    server_auth = Auth(tls=PeerTls(str(tls.ca), str(tls.server_cert), str(tls.server_key)))
    async with buddy(tmp_path / "b", server_auth) as receiver:
        aim(node, receiver)
        assert await node.sender.send_newest() is None
        await until(lambda: receiver.counts.auth_refused == 1)
        assert receiver.held == {} and receiver.counts.bytes_received == 0


# ---------------------------------------------------------------------------- failures
async def test_a_transfer_cut_in_the_middle_leaves_the_older_copy(tmp_path: Path) -> None:
    auth = Auth(secret=SECRET)
    node = make_node(tmp_path / "a", auth)
    async with buddy(tmp_path / "b", auth) as receiver:
        aim(node, receiver)
        node.save_all(3)
        await node.sender.send_newest()
        kept = {rank: kept_bytes(receiver, "node-a", rank) for rank in RANKS}
        files = region_files(receiver)
        node.save_all(4)
        newer = {rank: node.region_bytes(rank, 4) for rank in sorted(RANKS)}

        def cut() -> Answer:
            with socket.create_connection(("127.0.0.1", receiver.port), timeout=10) as raw:
                sock, key = auth.connect(raw)
                ranks = [RankCopy(rank, len(data), _checksum(node, rank, 4))
                         for rank, data in newer.items()]
                send_frame(sock, Push("node-a", 4, WORLD, ranks), key)
                answer = read_frame(sock, Answer, key)
                first = newer[min(newer)]
                sock.sendall(first[:len(first) // 2])  # half of the first rank, then gone
                return answer

        assert (await anyio.to_thread.run_sync(cut)).ok
        await until(lambda: receiver.counts.receives_failed == 1)
        assert receiver.held["node-a"].step == 3
        assert {rank: kept_bytes(receiver, "node-a", rank) for rank in RANKS} == kept
        await until(lambda: region_files(receiver) == files)  # the half copy is freed
        assert await node.sender.send_newest() == 4  # and the next transfer goes through
        assert receiver.held["node-a"].step == 4


def _checksum(node: Node, rank: int, step: int) -> int:
    slot = next(s for s in node.table.complete() if s.key == rank and s.step == step)
    assert slot.checksum is not None
    return slot.checksum


async def test_bytes_that_do_not_match_the_checksum_are_dropped(tmp_path: Path) -> None:
    auth = Auth(secret=SECRET)
    node = make_node(tmp_path / "a", auth)
    node.save_all(3)
    async with buddy(tmp_path / "b", auth) as receiver:
        data = node.region_bytes(2, 3)

        def forged() -> Answer:
            with socket.create_connection(("127.0.0.1", receiver.port), timeout=10) as raw:
                sock, key = auth.connect(raw)
                send_frame(sock, Push("node-a", 3, WORLD, [RankCopy(2, len(data), 12345)]),
                           key)
                read_frame(sock, Answer, key)
                sock.sendall(data)
                return read_frame(sock, Answer, key)

        answer = await anyio.to_thread.run_sync(forged)
        assert not answer.ok and "checksum" in answer.reason
        assert receiver.held == {} and receiver.counts.receives_failed == 1
        assert region_files(receiver) == set()


async def test_a_copy_above_the_limit_is_refused_and_the_older_one_stays(
        tmp_path: Path) -> None:
    auth = Auth(secret=SECRET)
    node = make_node(tmp_path / "a", auth)
    async with buddy(tmp_path / "b", auth, limit=2 * MIB) as receiver:
        aim(node, receiver)
        node.save_all(3)
        assert await node.sender.send_newest() == 3
        node.save_all(4, nbytes=3 * MIB)  # the state grew past what the buddy keeps
        assert await node.sender.send_newest() is None
        assert receiver.held["node-a"].step == 3
        assert receiver.counts.refused_no_room == 1
        assert node.sender.counts.refused_by_buddy == 1
        assert receiver.counts.bytes_received == node.sender.counts.bytes_sent  # none sent


async def test_a_copy_that_does_not_fit_the_buddys_memory_is_refused(tmp_path: Path) -> None:
    auth = Auth(secret=SECRET)
    node = make_node(tmp_path / "a", auth)
    node.save_all(3, nbytes=2 * MIB)  # two ranks of 3 MiB regions: 6 MiB
    with small_tmpfs(tmp_path / "shm", size="4m") as shm:
        async with buddy(shm, auth) as receiver:
            aim(node, receiver)
            assert await node.sender.send_newest() is None
            assert receiver.counts.refused_no_room == 1 and receiver.held == {}
            assert region_files(receiver) == set()  # the part that fitted is freed
            assert node.sender.counts.refused_by_buddy == 1


async def test_a_stalled_buddy_fails_the_transfer_at_its_timeout(tmp_path: Path) -> None:
    node = make_node(tmp_path / "a", Auth(secret=SECRET), io_timeout=0.5)
    node.save_all(3)
    with socket.create_server(("127.0.0.1", 0)) as listener:  # accepts, never speaks
        node.sender.aim(("127.0.0.1", listener.getsockname()[1]), RANKS, WORLD)
        with anyio.fail_after(10):
            assert await node.sender.send_newest() is None
    assert node.sender.counts.transfers_failed == 1 and node.table.readers == {}
    node.save_all(4)  # saves never waited for it


async def test_a_region_changed_since_its_save_is_never_sent(tmp_path: Path) -> None:
    auth = Auth(secret=SECRET)
    node = make_node(tmp_path / "a", auth)
    node.save_all(3)
    slot = next(s for s in node.table.complete() if s.key == 2)
    with open(node.regions.path(slot), "r+b") as region:  # a stray write: its directory
        region.seek(slot.size - 120)
        region.write(b"\xff" * 8)
    async with buddy(tmp_path / "b", auth) as receiver:
        aim(node, receiver)
        assert await node.sender.send_newest() is None
        assert node.sender.counts.transfers_failed == 1
        assert receiver.counts.as_dict() == ReplicaCounts().as_dict()  # never contacted


@pytest.mark.parametrize("expected", [frozenset({"node-b"})])
async def test_a_buddy_keeps_copies_only_of_the_nodes_it_expects(
        tmp_path: Path, expected: frozenset[str]) -> None:
    auth = Auth(secret=SECRET)
    node = make_node(tmp_path / "a", auth)
    node.save_all(3)
    async with buddy(tmp_path / "b", auth, expected=expected) as receiver:
        aim(node, receiver)
        assert await node.sender.send_newest() is None
        assert receiver.held == {} and node.sender.counts.refused_by_buddy == 1


async def test_a_step_the_buddy_keeps_already_is_not_sent_again(tmp_path: Path) -> None:
    auth = Auth(secret=SECRET)
    node = make_node(tmp_path / "a", auth)
    node.save_all(3)
    async with buddy(tmp_path / "b", auth) as receiver:
        aim(node, receiver)
        await node.sender.send_newest()
        sent = node.sender.counts.bytes_sent
        aim(node, receiver)  # a new round names the same buddy
        assert await node.sender.send_newest() == 3
        assert node.sender.counts.bytes_sent == sent and receiver.held["node-a"].step == 3


async def test_a_restart_to_an_older_step_frees_the_newer_copies(tmp_path: Path) -> None:
    auth = Auth(secret=SECRET)
    node = make_node(tmp_path / "a", auth)
    node.save_all(3)
    async with buddy(tmp_path / "b", auth) as receiver:
        aim(node, receiver)
        await node.sender.send_newest()
        receiver.trim(3)
        assert receiver.held["node-a"].step == 3
        receiver.trim(2)  # the job restores step 2: step 3 is another timeline now
        assert receiver.held == {} and region_files(receiver) == set()


async def test_an_offer_naming_a_rank_twice_is_refused(tmp_path: Path) -> None:
    auth = Auth(secret=SECRET)
    async with buddy(tmp_path / "b", auth) as receiver:

        def twice() -> Answer:
            with socket.create_connection(("127.0.0.1", receiver.port), timeout=10) as raw:
                sock, key = auth.connect(raw)
                copy = RankCopy(2, MIB, 1)
                send_frame(sock, Push("node-a", 3, WORLD, [copy, copy]), key)
                return read_frame(sock, Answer, key)

        answer = await anyio.to_thread.run_sync(twice)
        assert not answer.ok and "twice" in answer.reason
        assert region_files(receiver) == set()


async def test_a_sender_killed_in_the_middle_leaves_the_older_copy(tmp_path: Path) -> None:
    auth = Auth(secret=SECRET)
    (tmp_path / "a").mkdir()
    async with buddy(tmp_path / "b", auth) as receiver:
        command = [sys.executable, str(WORKERS / "buddy_sender.py"), str(receiver.port),
                   SECRET.hex(), str(tmp_path / "a")]
        async with await anyio.open_process(command) as process:
            assert process.stdout is not None
            lines = TextReceiveStream(process.stdout)
            with anyio.fail_after(30):
                assert (await lines.receive()).startswith("sent 1")
            kept = {rank: kept_bytes(receiver, "node-a", rank) for rank in RANKS}
            first = receiver.counts.bytes_received
            await until(lambda: receiver.counts.bytes_received > first)  # step 2 flows
            process.kill()
            await process.wait()
        await until(lambda: receiver.counts.receives_failed == 1)
        assert receiver.held["node-a"].step == 1
        assert {rank: kept_bytes(receiver, "node-a", rank) for rank in RANKS} == kept
        await until(lambda: len(region_files(receiver)) == len(RANKS))  # step 2's freed


async def test_a_buddy_that_stops_ends_a_transfer_in_flight_at_once(tmp_path: Path) -> None:
    auth = Auth(secret=SECRET)
    counts = ReplicaCounts()
    node = make_node(tmp_path / "a", auth, rate=float(MIB), counts=counts)
    node.save_all(3, nbytes=16 * MIB)  # 32 MiB at 1 MiB/s: half a minute if not ended
    async with anyio.create_task_group() as tg:
        async with buddy(tmp_path / "b", auth, counts=counts) as receiver:
            aim(node, receiver)
            tg.start_soon(node.sender.send_newest)
            await until(lambda: counts.bytes_received > 0)
        with anyio.fail_after(10):  # the buddy's supervisor stopped: the sender is told
            await until(lambda: counts.transfers_failed == 1)
    assert counts.receives_failed == 1 and node.table.readers == {}


# ---------------------------------------------------------------------------- fetching
async def test_a_member_fetches_a_kept_copy_bit_for_bit(tmp_path: Path) -> None:
    auth = Auth(secret=SECRET)
    node = make_node(tmp_path / "a", auth)
    node.save_all(3)
    (tmp_path / "c").mkdir()
    spare = Regions.create(tmp_path / "c")  # the node that takes over node-a's ranks
    counts = ReplicaCounts()
    async with buddy(tmp_path / "b", auth) as receiver:
        aim(node, receiver)
        await node.sender.send_newest()
        fetched = await fetch(("127.0.0.1", receiver.port), auth, RANKS, 3, spare,
                              counts=counts)
        assert (fetched.node, fetched.step, sorted(fetched.ranks)) == ("node-a", 3, [2, 3])
        for rank, held in fetched.ranks.items():
            data = (spare.directory / held.region).read_bytes()[:held.size]
            assert data == node.region_bytes(rank, 3)
        assert counts.copies_fetched == 1
        await until(lambda: receiver.counts.copies_served == 1)
        one = await fetch(("127.0.0.1", receiver.port), auth, frozenset({3}), 3, spare,
                          counts=counts)
        assert sorted(one.ranks) == [3]


async def test_a_fetch_of_a_step_not_kept_is_refused_and_leaves_nothing(
        tmp_path: Path) -> None:
    auth = Auth(secret=SECRET)
    node = make_node(tmp_path / "a", auth)
    node.save_all(3)
    (tmp_path / "c").mkdir()
    spare = Regions.create(tmp_path / "c")
    counts = ReplicaCounts()
    async with buddy(tmp_path / "b", auth) as receiver:
        aim(node, receiver)
        await node.sender.send_newest()
        with pytest.raises(Refused, match="no copy of step 2"):
            await fetch(("127.0.0.1", receiver.port), auth, RANKS, 2, spare, counts=counts)
        with pytest.raises(Refused, match="no copy of step 3"):
            await fetch(("127.0.0.1", receiver.port), auth, frozenset({0}), 3, spare,
                        counts=counts)
    assert os.listdir(spare.directory) == [] and counts.transfers_failed == 2


async def test_a_fetcher_without_the_secret_gets_nothing(tmp_path: Path) -> None:
    auth = Auth(secret=SECRET)
    node = make_node(tmp_path / "a", auth)
    node.save_all(3)
    (tmp_path / "c").mkdir()
    spare = Regions.create(tmp_path / "c")
    async with buddy(tmp_path / "b", auth) as receiver:
        aim(node, receiver)
        await node.sender.send_newest()
        served = receiver.counts.bytes_sent
        with pytest.raises(OSError):  # the buddy hangs up on it
            await fetch(("127.0.0.1", receiver.port), Auth(secret=b"a guess"), RANKS, 3,
                        spare, counts=ReplicaCounts())
        await until(lambda: receiver.counts.auth_refused == 1)
        assert receiver.counts.bytes_sent == served == 0
    assert os.listdir(spare.directory) == []


async def test_a_fetch_cut_in_the_middle_leaves_nothing(tmp_path: Path) -> None:
    auth = Auth(secret=SECRET)
    node = make_node(tmp_path / "a", auth)
    node.save_all(3)
    (tmp_path / "c").mkdir()
    spare = Regions.create(tmp_path / "c")
    data = node.region_bytes(2, 3)
    listener = socket.create_server(("127.0.0.1", 0))

    def half_a_buddy() -> None:  # proves itself, describes rank 2, sends half, hangs up
        conn, _ = listener.accept()
        with conn:
            sock, key = auth.accept(conn)
            read_frame(sock, Fetch, key)
            send_frame(sock, Answer(True), key)
            send_frame(sock, Push("node-a", 3, WORLD,
                                  [RankCopy(2, len(data), _checksum(node, 2, 3))]), key)
            sock.sendall(data[:len(data) // 2])

    with listener:
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, half_a_buddy)
            with pytest.raises(Cut):
                await fetch(("127.0.0.1", listener.getsockname()[1]), auth,
                            frozenset({2}), 3, spare, counts=ReplicaCounts())
    assert os.listdir(spare.directory) == []


async def test_a_replayed_proof_is_refused() -> None:
    auth = Auth(secret=SECRET)

    def session(answer: bytes | None) -> tuple[bytes, bool]:
        """One handshake over a socket pair: the client side answers with the secret, or
        replays ``answer``; returns what it sent and whether the server accepted."""
        server, client = socket.socketpair()
        with server, client:
            accepted: list[bool] = []

            def serve() -> None:
                try:
                    auth.accept(server)
                    accepted.append(True)
                except AuthRefused:
                    accepted.append(False)

            thread = threading.Thread(target=serve)
            thread.start()
            hello = client.recv(len(HELLO) + NONCE, socket.MSG_WAITALL)
            if answer is None:
                ours = os.urandom(NONCE)
                answer = ours + mac(SECRET, b"client" + hello[len(HELLO):] + ours)
            client.sendall(answer)
            thread.join(10)
            return answer, accepted == [True]

    recorded, ok = await anyio.to_thread.run_sync(session, None)
    assert ok
    _, replayed = await anyio.to_thread.run_sync(session, recorded)
    assert not replayed  # the server's nonce is new: an old proof proves nothing
