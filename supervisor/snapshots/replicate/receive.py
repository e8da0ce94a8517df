"""The buddy's side: a TCP server on ``--snapshot-port`` that keeps other nodes' copies.

The listening socket is the event loop's (accepting is cheap); each connection is then
served in a worker thread on a blocking socket, with a timeout on every read, so bulk
bytes never cross the loop. Bytes go straight into regions of shared memory this
supervisor creates for them (``Regions.reserve``: a full tmpfs is a refusal, never a
SIGBUS), next to the copy already kept: a transfer cut in the middle, or whose bytes do
not match the save's checksums, is dropped and the older copy stays. Only a transfer
checked whole replaces it. At most one transfer per sending node is in flight, so a
node keeps, per buddy rank, one copy and at most one being received.

The table of kept copies has one writer, the event loop: threads ask it to admit an
offer and to keep a checked copy (``anyio.from_thread``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
from anyio.abc import TaskStatus

from supervisor.core.buddies import Offer, Pace, admit
from supervisor.snapshots.memory import Regions
from supervisor.snapshots.replicate import stream
from supervisor.snapshots.replicate.auth import Auth
from supervisor.snapshots.replicate.stream import HeldRank
from supervisor.snapshots.replicate.wire import (
    MAX_RANKS,
    Abort,
    Answer,
    AuthRefused,
    Cut,
    Fetch,
    Push,
    RankCopy,
    ReplicaCounts,
    read_frame,
    read_request,
    send_frame,
)

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0  # seconds a peer has to prove itself
MAX_CONNECTIONS = 4  # served at once; more are closed at once (and counted)


@dataclass(frozen=True)
class HeldCopy:
    """A node's step kept here, whole and checked."""

    node: str
    step: int
    world_size: int
    ranks: dict[int, HeldRank]
    kept_at: float  # monotonic


@dataclass
class _Incoming:
    """A transfer being received: the regions it writes (dropped unless kept)."""

    push: Push
    regions: dict[int, HeldRank] = field(default_factory=dict)
    kept: bool = False


class BuddyReceiver:
    """Serves ``host:port`` and keeps what members send (one copy per sending node)."""

    def __init__(self, regions: Regions, auth: Auth, *, host: str = "0.0.0.0",
                 port: int = 0, limit: int | None = None,
                 expected: frozenset[str] | None = None, io_timeout: float = 30.0,
                 counts: ReplicaCounts | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.regions = regions
        self.auth = auth
        self.host = host
        self.port = port
        self.limit = limit  # --snapshot-memory-limit, per rank
        self.expected = expected  # nodes whose copy we keep (None: any member)
        self.io_timeout = io_timeout
        self.clock = clock
        self.counts = counts if counts is not None else ReplicaCounts()  # may be shared
        self.held: dict[str, HeldCopy] = {}
        self._receiving: set[str] = set()  # nodes with a transfer in flight
        self._served = 0  # connections being served
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ serving
    async def run(self, *, task_status: TaskStatus[int]) -> None:
        """Listen, report the bound port, serve until cancelled."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.create_server((self.host, self.port), family=family)
        listener.setblocking(False)
        try:
            self.port = listener.getsockname()[1]
            task_status.started(self.port)
            async with anyio.create_task_group() as tg:
                while True:
                    await anyio.wait_readable(listener)
                    try:
                        conn, _address = listener.accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError as exc:  # EMFILE and the like: not ours to die of
                        self._warn("accept", f"cannot accept a connection: {exc}")
                        await anyio.sleep(0.1)
                        continue
                    if self._served >= MAX_CONNECTIONS:
                        self.counts.add("busy_refused")
                        self._warn("busy", f"a connection is closed: {MAX_CONNECTIONS} "
                                   "are served already")
                        conn.close()
                        continue
                    self._served += 1  # now: the next accept sees it
                    tg.start_soon(self._serve, conn)
        finally:
            listener.close()

    async def _serve(self, conn: socket.socket) -> None:
        abort = Abort()
        try:
            await anyio.to_thread.run_sync(self._serve_blocking, conn, abort,
                                           abandon_on_cancel=True)
        finally:
            abort.abort()  # cancelled (the server stops): its thread ends at its next read
            self._served -= 1

    def _serve_blocking(self, conn: socket.socket, abort: Abort) -> None:
        conn.setblocking(True)
        conn.settimeout(HANDSHAKE_TIMEOUT)
        sock = conn
        try:
            try:
                abort.attach(conn)
                sock, key = self.auth.accept(conn)
                abort.attach(sock)  # TLS: the wrapped socket replaces the plain one
            except (AuthRefused, OSError) as exc:
                self.counts.add("auth_refused")
                self._warn("auth", f"refused a connection: {exc}")
                return
            self._receive(sock, key)
        finally:
            with contextlib.suppress(OSError):
                sock.close()
            with contextlib.suppress(OSError):
                conn.close()

    def _receive(self, sock: socket.socket, key: bytes | None) -> None:
        try:
            request = read_request(sock, key)
            if isinstance(request, Fetch):
                self._serve_fetch(sock, key, request)
            else:
                self._take(sock, key, request)
        except (Cut, OSError) as exc:  # cut, timed out, reset: the older copy stays
            self.counts.add("receives_failed")
            self._warn("cut", f"a buddy transfer failed: {exc}")

    def _take(self, sock: socket.socket, key: bytes | None, push: Push) -> None:
        """A member sends its copy: admit, stage, receive, check, keep (or refuse)."""
        held = self.held.get(push.node)  # a read of one dict entry: no race to fear
        if held is not None and held.step == push.step:
            send_frame(sock, Answer(True, held=True), key)
            return
        reason = anyio.from_thread.run_sync(self._admit, push)
        if reason is not None:
            send_frame(sock, Answer(False, reason), key)
            return
        incoming = _Incoming(push)
        try:
            try:
                incoming.regions = stream.stage(self.regions, push.ranks, "buddy")
            except OSError as exc:
                self.counts.add("refused_no_room")
                text = (f"no room for node {push.node!r}'s copy in {self.regions.directory}"
                        if exc.errno in (errno.ENOSPC, errno.ENOMEM)
                        else f"cannot make a region: {exc.strerror}")
                self._warn("room", f"a buddy copy is refused: {text}")
                self._release(incoming)  # before the answer: nothing lingers
                send_frame(sock, Answer(False, text), key)
                return
            send_frame(sock, Answer(True), key)
            sock.settimeout(self.io_timeout)
            stream.fill(sock, self.regions, incoming.regions, push.ranks, self.counts)
            failed = stream.check(self.regions, incoming.regions)
            if failed is not None:
                self.counts.add("receives_failed")
                self._warn("check", f"node {push.node!r}'s copy of step {push.step} "
                           f"is dropped: {failed}")
                self._release(incoming)
                send_frame(sock, Answer(False, failed), key)
                return
            anyio.from_thread.run_sync(self._keep, incoming)
            incoming.kept = True  # its regions are the kept copy's now
            self.counts.add("copies_received")
            send_frame(sock, Answer(True), key)
        finally:
            if not incoming.kept:
                self._release(incoming)

    def _release(self, incoming: _Incoming) -> None:
        """Free a transfer's regions: it will never be kept (idempotent)."""
        stream.drop(self.regions, incoming.regions.values())  # any thread may unlink
        incoming.regions = {}
        with contextlib.suppress(RuntimeError):  # the loop is gone, and the table with it
            anyio.from_thread.run_sync(self._receiving.discard, incoming.push.node)

    def _serve_fetch(self, sock: socket.socket, key: bytes | None, fetch: Fetch) -> None:
        """A member asks for ranks of a step kept here (it now runs them): the copy's
        description, then each rank's bytes from the kept regions."""
        found = anyio.from_thread.run_sync(self._find, fetch)
        if isinstance(found, str):
            send_frame(sock, Answer(False, found), key)
            return
        copy, ranks = found
        fds: list[int] = []
        try:
            try:
                fds = [stream.open_held(self.regions, copy.ranks[rank]) for rank in ranks]
            except FileNotFoundError:  # replaced by a newer step since it was found
                send_frame(sock, Answer(False, f"step {fetch.step} is no longer kept"), key)
                return
            send_frame(sock, Answer(True), key)
            send_frame(sock, Push(copy.node, copy.step, copy.world_size,
                                  [RankCopy(r, copy.ranks[r].size, copy.ranks[r].checksum)
                                   for r in ranks]), key)
            sock.settimeout(self.io_timeout)
            pace = Pace(None)  # a restore waits for these bytes: never paced
            for rank, fd in zip(ranks, fds, strict=True):
                stream.send_region(sock, fd, copy.ranks[rank].size,
                                   encrypted=self.auth.encrypted, pace=pace,
                                   clock=self.clock, counts=self.counts)
            if read_frame(sock, Answer, key).ok:
                self.counts.add("copies_served")
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    # ------------------------------------------------------------------ the table (loop)
    def _admit(self, push: Push) -> str | None:
        if len({c.rank for c in push.ranks}) != len(push.ranks):
            return "a rank given twice"
        if push.node in self._receiving:
            return f"a transfer from node {push.node!r} is already in flight"
        held = self.held.get(push.node)
        offer = Offer(push.node, push.step, push.world_size,
                      {c.rank: c.size for c in push.ranks},
                      {c.rank: c.checksum for c in push.ranks})
        reason = admit(offer, held.step if held else None, limit=self.limit,
                       expected=self.expected, max_ranks=MAX_RANKS)
        if reason is not None:
            if "limit" in reason:
                self.counts.add("refused_no_room")
                self._warn("room", f"a buddy copy is refused: {reason}")
            return reason
        self._receiving.add(push.node)
        return None

    def _keep(self, incoming: _Incoming) -> None:
        push = incoming.push
        self._receiving.discard(push.node)
        old = self.held.get(push.node)
        self.held[push.node] = HeldCopy(push.node, push.step, push.world_size,
                                        dict(incoming.regions), self.clock())
        if old is not None:
            self._drop(old.ranks.values())
        logger.info("buddy copy of node %r step %d kept (%d ranks)", push.node, push.step,
                    len(push.ranks))

    def _drop(self, ranks: Iterable[HeldRank]) -> None:
        stream.drop(self.regions, ranks)

    def _find(self, fetch: Fetch) -> tuple[HeldCopy, list[int]] | str:
        """The kept copy holding every rank ``fetch`` asks for at its step, or why not."""
        wanted = sorted(set(fetch.ranks))
        if not wanted or len(wanted) > MAX_RANKS:
            return f"{len(wanted)} ranks: expected 1 to {MAX_RANKS}"
        for copy in self.held.values():
            if copy.step == fetch.step and set(wanted) <= set(copy.ranks):
                return copy, wanted
        return f"no copy of step {fetch.step} holding ranks {wanted} is kept here"

    def trim(self, step: int | None) -> None:
        """A restart restores ``step`` (None: nothing): copies of newer steps belong to
        the timeline it abandons and are freed (the integration's call, per round)."""
        for node, copy in list(self.held.items()):
            if step is None or copy.step > step:
                self.forget(node)

    def forget(self, node: str) -> None:
        """Free ``node``'s kept copy (the integration's call: no longer needed)."""
        copy = self.held.pop(node, None)
        if copy is not None:
            self._drop(copy.ranks.values())

    # ------------------------------------------------------------------ read model
    def memory(self) -> int:
        """Bytes of shared memory the kept copies hold."""
        return sum(r.capacity for c in self.held.values() for r in c.ranks.values())

    def status(self) -> dict[str, Any]:
        now = self.clock()
        return {
            "port": self.port,
            "memory_bytes": self.memory(),
            "held": {node: {"step": c.step, "ranks": sorted(c.ranks),
                            "age": round(now - c.kept_at, 3)}
                     for node, c in self.held.items()},
        }

    def _warn(self, kind: str, text: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning("%s (further ones are counted)", text)
