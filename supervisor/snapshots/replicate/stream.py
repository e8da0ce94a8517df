"""Moving a snapshot's bytes between a region and a connection, both ways (blocking: in
worker threads), and checking what arrived.

Sending streams from the region's pages: ``sendfile`` on a plain connection (the kernel
copies), a read-only mapping a chunk at a time under TLS. Receiving writes into a region
made for it (``Regions.reserve``: a full tmpfs is a clean ``OSError``), through a
writable mapping; the bytes count only after ``check`` read them all back against the
save's checksums. Regions that will not be kept are dropped by their maker.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from supervisor.core.buddies import Pace
from supervisor.core.slots import region_size
from supervisor.snapshots import zipformat
from supervisor.snapshots.memory import Regions
from supervisor.snapshots.replicate.wire import RankCopy, ReplicaCounts, recv_into_exact

CHUNK = 4 << 20  # bytes per send (and per update of the counters)
MIN_CHUNK = 64 << 10
RECEIVE_CHUNK = 1 << 20
_NAMES = itertools.count()


@dataclass(frozen=True)
class HeldRank:
    """One rank's snapshot in a region of ours: the region's name, size and checksum."""

    region: str
    size: int
    checksum: int
    capacity: int


def send_region(sock: socket.socket, fd: int, size: int, *, encrypted: bool, pace: Pace,
                clock: Callable[[], float], counts: ReplicaCounts) -> None:
    """Send the first ``size`` bytes of the region ``fd``, paced."""
    with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as mapped, \
            open(fd, "rb", closefd=False) as source:
        view = memoryview(mapped)
        # paced: a twentieth of a second's bytes per send, so a low rate is smooth
        chunk = CHUNK if pace.rate is None else int(max(MIN_CHUNK, min(CHUNK, pace.rate / 20)))
        try:
            for offset in range(0, size, chunk):
                count = min(chunk, size - offset)
                wait = pace.delay(count, clock())
                if wait > 0:
                    time.sleep(wait)  # a worker thread: the pace is the point
                if encrypted:  # TLS encrypts in our memory, a chunk at a time
                    with view[offset:offset + count] as part:
                        sock.sendall(part)
                else:  # the kernel copies from the region's pages to the socket
                    sock.sendfile(source, offset, count)
                counts.add("bytes_sent", count)
        finally:
            view.release()


def stage(regions: Regions, copies: Iterable[RankCopy], prefix: str
          ) -> dict[int, HeldRank]:
    """A region for each rank of ``copies``, every page reserved; ``OSError`` (ENOSPC:
    no room) with none of them left behind."""
    staged: dict[int, HeldRank] = {}
    try:
        for copy in copies:
            name = f"{prefix}{next(_NAMES)}-rank{copy.rank}"
            capacity = region_size(copy.size)
            regions.reserve(name, capacity)
            staged[copy.rank] = HeldRank(name, copy.size, copy.checksum, capacity)
    except OSError:
        drop(regions, staged.values())
        raise
    return staged


def fill(sock: socket.socket, regions: Regions, staged: dict[int, HeldRank],
         copies: Iterable[RankCopy], counts: ReplicaCounts) -> None:
    """Receive each rank's bytes, in the order of ``copies``, into its staged region."""
    for copy in copies:
        with mapped(regions, staged[copy.rank], writable=True) as view:
            for offset in range(0, copy.size, RECEIVE_CHUNK):
                end = min(offset + RECEIVE_CHUNK, copy.size)
                with view[offset:end] as part:  # released even when the transfer is cut
                    recv_into_exact(sock, part)
                counts.add("bytes_received", end - offset)


def check(regions: Regions, staged: dict[int, HeldRank]) -> str | None:
    """Why the received bytes do not count (a rank failing its checksums), or None."""
    for rank, held in sorted(staged.items()):
        with mapped(regions, held) as view:
            if not zipformat.verify(view, held.size, held.checksum):
                return f"rank {rank}'s bytes do not match the save's checksum"
    return None


def drop(regions: Regions, ranks: Iterable[HeldRank]) -> None:
    for rank in ranks:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(regions.directory / rank.region)


def open_held(regions: Regions, rank: HeldRank) -> int:
    """A read-only descriptor of a kept rank's region (its bytes outlive a replacement:
    a newer copy goes to new regions and only unlinks this one)."""
    return os.open(regions.directory / rank.region, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)


@contextlib.contextmanager
def mapped(regions: Regions, rank: HeldRank, *, writable: bool = False
           ) -> Iterator[memoryview]:
    flags = os.O_RDWR if writable else os.O_RDONLY
    fd = os.open(regions.directory / rank.region, flags | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        access = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        with mmap.mmap(fd, rank.capacity, mmap.MAP_SHARED, access) as region:
            view = memoryview(region)
            try:
                yield view
            finally:
                view.release()
    finally:
        os.close(fd)
