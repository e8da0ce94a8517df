"""The snapshot socket: where workers reserve a slot, say a save is complete, ask what to
restore.

A Unix stream socket in the supervisor's private runtime directory (0700; the socket
0600), one connection per worker process, one JSON object per line each way. Who speaks
is the kernel's word, not the message's: the peer's pid comes from ``SO_PEERCRED`` and
must be a live worker of the current attempt (or its descendant), checked at every
message, as the deadline FIFO checks a request's pid; a message naming another rank than
that worker's is forged. Malformed, oversized, forged and foreign messages are counted
and answered with a refusal; nothing a worker sends can crash the supervisor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec
from anyio.abc import SocketAttribute, SocketStream, TaskStatus

logger = logging.getLogger(__name__)

MAX_LINE = 4096


class Reserve(msgspec.Struct, frozen=True, tag_field="op", tag="reserve",
              forbid_unknown_fields=True):
    rank: int
    step: int
    size: int
    replicated: bool = False


class Commit(msgspec.Struct, frozen=True, tag_field="op", tag="commit",
             forbid_unknown_fields=True):
    rank: int
    step: int
    slot: int
    size: int
    checksum: int
    replicated: bool = False


class RestoreQuery(msgspec.Struct, frozen=True, tag_field="op", tag="restore",
                   forbid_unknown_fields=True):
    rank: int


Request = Reserve | Commit | RestoreQuery
_DECODER = msgspec.json.Decoder(Request)


@dataclass(frozen=True)
class Sender:
    """The worker a message comes from, as the kernel and the current attempt say."""

    pid: int
    local_rank: int
    global_rank: int


@dataclass
class ChannelCounts:
    """What the channel refused (shown in /metrics)."""

    malformed: int = 0
    forged: int = 0  # a rank that is not the sender's
    foreign: int = 0  # not a live worker of the current attempt
    by_kind: dict[str, int] = field(default_factory=dict)


# pid -> the live worker of the current attempt that is or owns it, else None
Identify = Callable[[int], Sender | None]
Handle = Callable[[Request, Sender], Awaitable[dict[str, Any]]]


class SnapshotChannel:
    """Serves the snapshot socket at ``path``."""

    def __init__(self, path: Path, identify: Identify, handle: Handle) -> None:
        self.path = path
        self.identify = identify
        self.handle = handle
        self.counts = ChannelCounts()

    async def run(self, *, task_status: TaskStatus[Path]) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        listener = await anyio.create_unix_listener(self.path)
        os.chmod(self.path, 0o600)
        try:
            task_status.started(self.path)
            await listener.serve(self._serve)
        finally:
            with anyio.CancelScope(shield=True):
                await listener.aclose()
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    async def _serve(self, stream: SocketStream) -> None:
        async with stream:
            pid = _peer_pid(stream.extra(SocketAttribute.raw_socket))
            buffered = b""
            try:
                while True:
                    chunk = await stream.receive()
                    buffered += chunk
                    while b"\n" in buffered:
                        line, buffered = buffered.split(b"\n", 1)
                        await stream.send(await self._answer(line, pid) + b"\n")
                    if len(buffered) > MAX_LINE:
                        self._count("malformed")
                        return  # no framing left to trust: hang up
            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                return

    async def _answer(self, line: bytes, pid: int) -> bytes:
        if len(line) > MAX_LINE:
            return self._refuse("malformed", "message too long")
        try:
            request = _DECODER.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return self._refuse("malformed", f"malformed message: {exc}")
        sender = self.identify(pid)
        if sender is None:
            return self._refuse("foreign", f"pid {pid} is not a live worker of the current "
                                "attempt")
        if request.rank != sender.global_rank:
            return self._refuse("forged", f"pid {pid} is rank {sender.global_rank}, not "
                                f"rank {request.rank}")
        try:
            reply = await self.handle(request, sender)
        except Exception:  # a bug of ours must not end the supervisor: log, refuse
            logger.exception("snapshot request %r failed", request)
            reply = {"ok": False, "reason": "internal error (see the supervisor's log)"}
        return msgspec.json.encode(reply)

    def _refuse(self, kind: str, reason: str) -> bytes:
        self._count(kind)
        if self.counts.by_kind[kind] == 1:  # one line per kind; the rest are counted
            logger.warning("snapshot socket: %s (further ones are counted only)", reason)
        return msgspec.json.encode({"ok": False, "reason": reason})

    def _count(self, kind: str) -> None:
        setattr(self.counts, kind, getattr(self.counts, kind) + 1)
        self.counts.by_kind[kind] = self.counts.by_kind.get(kind, 0) + 1


def _peer_pid(sock: socket.socket) -> int:
    """The pid of the process at the other end, as the kernel recorded it at connect."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, _uid, _gid = struct.unpack("3i", creds)
    return int(pid)
