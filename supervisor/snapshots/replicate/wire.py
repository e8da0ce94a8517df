"""What crosses a buddy connection, how it is framed, and what is counted.

After authentication (``auth``) the sender writes one ``Push`` frame; the buddy answers
with an ``Answer`` (taken, or refused and why: no bytes follow a refusal); the sender
streams each rank's bytes, in the order of ``Push.ranks``, exactly ``size`` each; the
buddy answers again once every rank is checked and kept. A member that fetches writes a
``Fetch`` instead; the buddy answers, describes the copy in a ``Push``, streams it, and
the fetcher answers once it checked it. A frame is a 4-byte big-endian
length and a msgspec JSON body, followed, when the connection has a session key (the
per-job secret), by the body's HMAC-SHA256 under that key. Blocking sockets only: this
runs in worker threads.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import socket
import struct
import threading
from dataclasses import dataclass, field, fields
from typing import TypeVar

import msgspec

MAX_FRAME = 1 << 16  # a Push of thousands of ranks fits; nothing larger is read
MAX_RANKS = 1024  # global ranks one node may send
_LENGTH = struct.Struct("!I")
MAC_SIZE = 32
T = TypeVar("T")


class RankCopy(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    rank: int
    size: int
    checksum: int


class Push(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="op",
           tag="push"):
    """A node offers its ranks' snapshots of ``step`` (and a buddy describes what it
    sends back for a ``Fetch``)."""

    node: str
    step: int
    world_size: int
    ranks: list[RankCopy]


class Fetch(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="op",
            tag="fetch"):
    """A member asks for the copies of ``ranks`` at ``step`` (it runs those ranks now)."""

    ranks: list[int]
    step: int


Request = Push | Fetch


class Answer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    ok: bool
    reason: str = ""
    held: bool = False  # the buddy keeps this very step already: nothing to send


class Cut(OSError):
    """The peer closed the connection, or a frame was malformed: the transfer is void."""


class AuthRefused(Exception):
    """The peer could not prove it belongs to the job."""


class Refused(Exception):
    """The buddy refused the copy (before any bytes were sent, or after a failed check)."""


@dataclass
class ReplicaCounts:
    """Buddy copies on this node, both directions (``/metrics``): one instance given to
    the node's sender and receiver. Threads add to it."""

    bytes_sent: int = 0
    bytes_received: int = 0
    copies_sent: int = 0  # the buddy checked and kept them
    copies_received: int = 0  # checked and kept here
    transfers_failed: int = 0  # sends that did not end in a kept copy (any reason)
    receives_failed: int = 0  # incoming transfers cut, timed out or failing a checksum
    auth_refused: int = 0  # peers that could not prove they belong (either direction)
    refused_no_room: int = 0  # copies refused here: over the limit or the tmpfs is full
    refused_by_buddy: int = 0  # copies our buddy refused
    busy_refused: int = 0  # connections closed at once: too many served already
    copies_served: int = 0  # kept copies fetched from here by a member
    copies_fetched: int = 0  # copies fetched from a buddy, checked
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False,
                                  compare=False)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + amount)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if not f.name.startswith("_")}


class Abort:
    """Lets the event loop end a transfer its thread is blocked in (shut the socket)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.aborted = False

    def attach(self, sock: socket.socket) -> None:
        with self._lock:
            self._sock = sock
            if self.aborted:
                raise Cut("the transfer was aborted")

    def abort(self) -> None:
        with self._lock:
            self.aborted = True
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)


def mac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def send_frame(sock: socket.socket, message: msgspec.Struct, key: bytes | None) -> None:
    body = msgspec.json.encode(message)
    sock.sendall(_LENGTH.pack(len(body)) + body + (mac(key, body) if key else b""))


def read_frame(sock: socket.socket, kind: type[T], key: bytes | None) -> T:
    """One frame decoded as ``kind``; ``Cut`` if it is not one (or its MAC is wrong)."""
    return _decode(_read_body(sock, key), msgspec.json.Decoder(kind))


def read_request(sock: socket.socket, key: bytes | None) -> Push | Fetch:
    """The first frame a buddy's server reads: a ``Push`` or a ``Fetch``."""
    return _decode(_read_body(sock, key), _REQUEST)


_REQUEST = msgspec.json.Decoder(Request)


def _read_body(sock: socket.socket, key: bytes | None) -> bytes:
    (length,) = _LENGTH.unpack(recv_exact(sock, _LENGTH.size))
    if length > MAX_FRAME:
        raise Cut(f"a frame of {length} bytes")
    body = recv_exact(sock, length)
    if key is not None and not hmac.compare_digest(recv_exact(sock, MAC_SIZE),
                                                   mac(key, body)):
        raise Cut("a frame whose MAC does not match the session's")
    return body


def _decode(body: bytes, decoder: msgspec.json.Decoder[T]) -> T:
    try:
        return decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise Cut(f"a malformed frame: {exc}") from None


def recv_exact(sock: socket.socket, size: int) -> bytes:
    """``size`` bytes (small reads only: frames and handshakes)."""
    buffer = bytearray(size)
    recv_into_exact(sock, memoryview(buffer))
    return bytes(buffer)


def recv_into_exact(sock: socket.socket, view: memoryview) -> int:
    """Fill ``view`` from ``sock``; ``Cut`` if the peer closes first."""
    done = 0
    while done < len(view):
        got = sock.recv_into(view[done:])
        if got == 0:
            raise Cut(f"the peer closed the connection after {done} of {len(view)} bytes")
        done += got
    return done
