"""The sending side: this node's newest complete step, to its buddy.

``push`` is one transfer, blocking, run in a worker thread: connect, prove membership
(``auth``), offer the step, and, once the buddy takes it, stream each rank's region
straight from shared memory (``sendfile`` from the region's file on a plain connection,
a read-only mapping under TLS: never a copy of the state in our memory), paced by
``--snapshot-replicate-rate``. The slots being sent are pinned as readers in the slot
table, so the worker's next saves write other slots (a rank has three) and a save is
never delayed or refused by a transfer; a restart does not wait for one either.

``BuddySender`` is the task that decides what to send: whenever it is woken (a save was
committed, the buddy changed) and the newest step complete for every rank of this node
is newer than the one the buddy has, it sends it. A transfer that fails is counted and
reported once, and retried with the newest step then, at the latest after a backoff.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
from anyio.abc import TaskStatus

from supervisor.core.buddies import Outgoing, Pace, newest_local
from supervisor.core.slots import Slot, SlotTable
from supervisor.snapshots import zipformat
from supervisor.snapshots.replicate.auth import Auth
from supervisor.snapshots.replicate.stream import send_region
from supervisor.snapshots.replicate.wire import (
    Abort,
    Answer,
    AuthRefused,
    Push,
    RankCopy,
    Refused,
    ReplicaCounts,
    read_frame,
    send_frame,
)

logger = logging.getLogger(__name__)

Address = tuple[str, int]
OpenRegion = Callable[[Slot], int]  # a read-only descriptor of a slot's region


class Stale(Exception):
    """A region no longer holds the save its worker reported: not sent."""


@dataclass(frozen=True)
class Transfer:
    """What one push needs besides the step."""

    address: Address
    auth: Auth
    node: str  # this node's id, as the buddy knows it
    open_region: OpenRegion
    rate: float | None
    io_timeout: float
    counts: ReplicaCounts


def push(transfer: Transfer, outgoing: Outgoing, abort: Abort,
         clock: Callable[[], float] = time.monotonic) -> None:
    """Send ``outgoing`` to the buddy; returns once the buddy checked and kept it.
    Raises ``AuthRefused``, ``Refused`` (by the buddy), ``Stale`` (a region changed
    since its save), ``Cut`` or ``OSError`` (the connection failed or timed out)."""
    ranks = sorted(outgoing.slots.items())
    fds: list[int] = []
    try:
        for _rank, slot in ranks:
            fds.append(transfer.open_region(slot))
            _check_region(fds[-1], slot)  # before anything is offered
        _push(transfer, outgoing.step, outgoing.world_size, list(zip(ranks, fds, strict=True)),
              abort, clock)
    finally:
        for fd in fds:
            os.close(fd)


def _push(transfer: Transfer, step: int, world_size: int,
          regions: list[tuple[tuple[int, Slot], int]], abort: Abort,
          clock: Callable[[], float]) -> None:
    raw = socket.create_connection(transfer.address, timeout=transfer.io_timeout)
    sock = raw
    try:
        abort.attach(raw)
        sock, key = transfer.auth.connect(raw)
        abort.attach(sock)
        copies = [RankCopy(rank, slot.size, slot.checksum or 0)
                  for (rank, slot), _fd in regions]
        send_frame(sock, Push(transfer.node, step, world_size, copies), key)
        if _expect_ok(read_frame(sock, Answer, key)).held:
            return  # the buddy keeps this step already (a round that named it again)
        pace = Pace(transfer.rate)
        for (_rank, slot), fd in regions:
            send_region(sock, fd, slot.size, encrypted=transfer.auth.encrypted, pace=pace,
                        clock=clock, counts=transfer.counts)
        _expect_ok(read_frame(sock, Answer, key))
    finally:
        with contextlib.suppress(OSError):
            sock.close()
        with contextlib.suppress(OSError):
            raw.close()


def _check_region(fd: int, slot: Slot) -> None:
    """The region still holds the save its worker reported (a stray write since is never
    sent; the buddy checks every byte again on its side). ``Stale`` if not."""
    with mmap.mmap(fd, slot.size, mmap.MAP_SHARED, mmap.PROT_READ) as mapped:
        view = memoryview(mapped)
        try:
            found = zipformat.directory_checksum(view, slot.size)
        finally:
            view.release()
    if found != slot.checksum:
        raise Stale(f"{slot.name} no longer holds step {slot.step}")


def _expect_ok(answer: Answer) -> Answer:
    if not answer.ok:
        raise Refused(answer.reason)
    return answer


class BuddySender:
    """Sends this node's newest complete step to its buddy, again at every newer one."""

    def __init__(self, table: SlotTable, open_region: OpenRegion, auth: Auth, node: str,
                 *, rate: float | None = None, io_timeout: float = 30.0,
                 retry: tuple[float, float] = (1.0, 30.0),
                 counts: ReplicaCounts | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.table = table
        self.open_region = open_region
        self.auth = auth
        self.node = node
        self.rate = rate
        self.io_timeout = io_timeout
        self.retry = retry
        self.clock = clock
        self.counts = counts if counts is not None else ReplicaCounts()  # may be shared
        self.buddy: Address | None = None
        self.ranks: frozenset[int] = frozenset()
        self.world_size = 0
        self.sent: tuple[Address, int] | None = None  # the buddy and the step it keeps
        self.sent_at: float | None = None
        self.failures = 0  # in a row
        self._wake = anyio.Event()
        self._aimed = anyio.Event()
        self._warned: set[str] = set()

    def aim(self, buddy: Address | None, ranks: frozenset[int], world_size: int) -> None:
        """This round's buddy and this node's global ranks (the integration's call, at
        every round: what was sent before is offered again, and a buddy that keeps that
        step already says so without a byte sent)."""
        self.buddy, self.ranks, self.world_size = buddy, ranks, world_size
        self.sent = None
        self.failures = 0
        self._aimed.set()
        self.wake()

    def wake(self) -> None:
        """A save was committed or the buddy changed: look again."""
        self._wake.set()

    async def run(self, *, task_status: TaskStatus[None]) -> None:
        """Send whenever woken; after a failure, again after the backoff (a buddy that is
        gone is not called at every save), or at once when a new round aims elsewhere."""
        task_status.started()
        while True:
            if self.failures:
                with anyio.move_on_after(min(self.retry[1],
                                             self.retry[0] * 2 ** (self.failures - 1))):
                    await self._aimed.wait()
            else:
                await self._wake.wait()
            self._wake, self._aimed = anyio.Event(), anyio.Event()
            await self.send_newest()

    async def send_newest(self) -> int | None:
        """One transfer of the newest complete step, if the buddy lacks it; the step sent."""
        buddy = self.buddy
        outgoing = newest_local(self.table.complete(), self.ranks, self.world_size)
        if buddy is None or outgoing is None or (
                self.sent is not None and self.sent[0] == buddy
                and outgoing.step <= self.sent[1]):
            return None
        transfer = Transfer(buddy, self.auth, self.node, self.open_region, self.rate,
                            self.io_timeout, self.counts)
        for slot in outgoing.slots.values():
            self.table.add_reader(slot)
        abort = Abort()
        try:
            await anyio.to_thread.run_sync(push, transfer, outgoing, abort, self.clock,
                                           abandon_on_cancel=True)
        except (AuthRefused, Refused, Stale, OSError) as exc:
            self._failed(buddy, outgoing.step, exc)
            return None
        finally:
            abort.abort()  # a cancelled wait: the thread stops at its next read or write
            for slot in outgoing.slots.values():
                self.table.drop_reader(slot)
        self.failures = 0
        self.sent, self.sent_at = (buddy, outgoing.step), self.clock()
        self.counts.add("copies_sent")
        return outgoing.step

    def _failed(self, buddy: Address, step: int, exc: Exception) -> None:
        self.failures += 1
        self.counts.add("transfers_failed")
        kind = type(exc).__name__
        if isinstance(exc, AuthRefused):
            self.counts.add("auth_refused")
        elif isinstance(exc, Refused):
            self.counts.add("refused_by_buddy")
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning("buddy copy of step %d to %s:%d not made: %s (retried with the "
                           "newest step; further failures are counted)", step, *buddy, exc)

    def status(self) -> dict[str, Any]:
        now = self.clock()
        return {
            "buddy": None if self.buddy is None else f"{self.buddy[0]}:{self.buddy[1]}",
            "sent_step": None if self.sent is None else self.sent[1],
            "sent_age": None if self.sent_at is None else round(now - self.sent_at, 3),
            "failures_in_a_row": self.failures,
        }
