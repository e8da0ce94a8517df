"""Fetching a kept copy back from a buddy: the node that now runs a lost node's ranks
asks the buddy that kept them for their state at the step the job restores.

``fetch`` connects, proves membership (``auth``; the buddy must prove itself too), asks
for ``ranks`` at ``step``, and receives each rank into a region of its own, made for it
(a full tmpfs is a clean failure); the bytes count only once every rank is checked
against the save's checksums the buddy kept with it. Anything else (a refusal, a cut, a
timeout, a mismatch) raises, with every region it made dropped: never a torn state.
Putting the fetched regions in the slot table for the workers' ``load()`` is the
rendezvous integration's part, not built yet.
"""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass

import anyio
import anyio.to_thread

from supervisor.snapshots.memory import Regions
from supervisor.snapshots.replicate import stream
from supervisor.snapshots.replicate.auth import Auth
from supervisor.snapshots.replicate.stream import HeldRank
from supervisor.snapshots.replicate.wire import (
    Abort,
    Answer,
    AuthRefused,
    Cut,
    Fetch,
    Push,
    Refused,
    ReplicaCounts,
    read_frame,
    send_frame,
)


@dataclass(frozen=True)
class Fetched:
    """Ranks fetched and checked, in regions of ours (``Regions.directory / region``)."""

    node: str  # the node whose copy it was
    step: int
    world_size: int
    ranks: dict[int, HeldRank]


async def fetch(address: tuple[str, int], auth: Auth, ranks: frozenset[int], step: int,
                regions: Regions, *, counts: ReplicaCounts, io_timeout: float = 30.0
                ) -> Fetched:
    """The copies of ``ranks`` at ``step`` from the buddy at ``address``. Raises
    ``AuthRefused``, ``Refused`` (not kept there, or failing its checksums), ``Cut`` or
    ``OSError``; nothing is left in ``regions`` then."""
    abort = Abort()
    try:
        fetched = await anyio.to_thread.run_sync(
            _fetch, address, auth, sorted(ranks), step, regions, counts, io_timeout, abort,
            abandon_on_cancel=True)
    except Exception as exc:  # counted here, reported by the caller (it decides what next)
        counts.add("transfers_failed")
        if isinstance(exc, AuthRefused):
            counts.add("auth_refused")
        raise
    finally:
        abort.abort()
    counts.add("copies_fetched")
    return fetched


def _fetch(address: tuple[str, int], auth: Auth, ranks: list[int], step: int,
           regions: Regions, counts: ReplicaCounts, io_timeout: float,
           abort: Abort) -> Fetched:
    raw = socket.create_connection(address, timeout=io_timeout)
    sock = raw
    staged: dict[int, HeldRank] = {}
    kept = False
    try:
        abort.attach(raw)
        sock, key = auth.connect(raw)
        abort.attach(sock)
        send_frame(sock, Fetch(ranks, step), key)
        answer = read_frame(sock, Answer, key)
        if not answer.ok:
            raise Refused(answer.reason)
        described = read_frame(sock, Push, key)
        if described.step != step or sorted(c.rank for c in described.ranks) != ranks \
                or any(c.size <= 0 for c in described.ranks):
            raise Cut(f"the buddy describes another copy than step {step} of ranks {ranks}")
        staged = stream.stage(regions, described.ranks, "fetched")
        stream.fill(sock, regions, staged, described.ranks, counts)
        failed = stream.check(regions, staged)
        if failed is not None:
            send_frame(sock, Answer(False, failed), key)
            raise Refused(failed)
        send_frame(sock, Answer(True), key)
        kept = True
        return Fetched(described.node, described.step, described.world_size, staged)
    finally:
        if not kept:
            stream.drop(regions, staged.values())
        with contextlib.suppress(OSError):
            sock.close()
        with contextlib.suppress(OSError):
            raw.close()
