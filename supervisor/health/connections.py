"""The health server's connection cap: which connection is closed for room, and when.

At ``MAX_CONNECTIONS`` open connections (``server.py``) one without a complete request is
closed to make room for the new one, so an attacker can only push out its own
connections, never a probe's (``ConnectionLedger``). Two hooks on aiohttp's ``Server``
feed the ledger (``cap_connections``): a tap between each transport and its handler says
as soon as a request's headers are read, and whether it is a probe; a peek at what waits
unread in the kernel (``pending_on``) says which not-yet-read connections hold one.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import IntEnum

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

PEEK_BYTES = 2048  # a probe's request fits (kubelet's is ~150 bytes)


class Pending(IntEnum):
    """What an unread connection holds, from first to last closed for room at the cap."""

    CLOSING = 0  # already being closed: closing it again costs nothing
    OTHER = 1  # bytes that are not a complete probe: a POST, a half-sent request
    NOTHING = 2  # nothing: idle after a response, or a client that has not written yet
    PROBE = 3  # a complete GET or HEAD request


class ConnectionLedger:
    """The open connections: waiting for a request, reading a request's body, or busy.

    A connection is *waiting* from its opening, and again from the end of each response,
    until its request's headers have been read; it is *reading* from then, if the request
    is not a probe, until it is handled, and again while its handler waits for the body;
    it is *busy* while its request is otherwise handled. At the cap one is closed to make
    room: the oldest *reading* one (a POST whose body has not come: its sender can resend,
    a probe has no body), else the waiting one that holds least
    (``Pending``, oldest first), else the new connection itself, when every other one is
    busy or holds a complete probe. Busy connections are never closed for room: their
    requests need no more input.

    ``pending(transport)`` looks at what waits unread in the kernel (``pending_on``).
    Without it an attacker reconnecting faster than the server reads would push out a
    probe that has connected but not yet been read: connections are accepted in bursts,
    and a newer burst is opened before the older one's requests are read.
    """

    def __init__(
        self, limit: int, pending: Callable[[asyncio.BaseTransport], Pending] | None = None
    ) -> None:
        if limit < 1:
            raise ValueError(f"connection limit must be >= 1, got {limit}")
        self.limit = limit
        self._pending = pending or (lambda transport: Pending.NOTHING)
        self._waiting: dict[object, asyncio.BaseTransport] = {}
        self._reading: dict[object, asyncio.BaseTransport] = {}
        self._busy: dict[object, asyncio.BaseTransport] = {}
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._waiting) + len(self._reading) + len(self._busy)

    def opened(
        self, conn: object, transport: asyncio.BaseTransport
    ) -> asyncio.BaseTransport | None:
        """A connection opened; returns the transport to close to stay within the limit."""
        self._waiting[conn] = transport
        if len(self) <= self.limit:
            return None
        group, victim = self._victim(conn)
        self.evicted += victim is not conn
        return group.pop(victim)

    def _victim(self, new: object) -> tuple[dict[object, asyncio.BaseTransport], object]:
        if self._reading:
            return self._reading, next(iter(self._reading))
        best, least = new, Pending.PROBE
        for conn, transport in self._waiting.items():  # oldest first
            if conn is new:
                continue
            held = self._pending(transport)
            if held < least:
                best, least = conn, held
                if held <= Pending.OTHER:  # no better one is worth more peeks
                    break
        return self._waiting, best

    def closed(self, conn: object) -> None:
        """A connection is gone (closed by either side)."""
        for group in (self._waiting, self._reading, self._busy):
            group.pop(conn, None)

    def headers_read(self, conn: object, probe: bool) -> None:
        """A request's headers were read on ``conn``, not yet handled: a probe (GET, HEAD)
        is never closed for room from now; any other request is closed first."""
        _move(conn, self._waiting, self._busy if probe else self._reading)

    def request_started(self, conn: object) -> None:
        """``conn``'s request is being handled."""
        _move(conn, self._waiting, self._busy)
        _move(conn, self._reading, self._busy)

    def request_done(self, conn: object) -> None:
        """The response was handed to the transport: waiting again, as the newest."""
        _move(conn, self._busy, self._waiting)

    @contextmanager
    def reading_body(self, conn: object) -> Iterator[None]:
        """While the handler of ``conn``'s request waits for its body: closed first for room."""
        _move(conn, self._busy, self._reading)
        try:
            yield
        finally:
            _move(conn, self._reading, self._busy)


def pending_on(transport: asyncio.BaseTransport) -> Pending:
    """What waits unread in the kernel on ``transport``: peeked, so aiohttp reads it as usual.

    A probe's request is small and sent at once; one that does not fit ``PEEK_BYTES``
    is not protected.
    """
    raw = transport.get_extra_info("socket")
    if raw is None or transport.is_closing():
        return Pending.CLOSING
    try:
        sock = socket.socket(fileno=raw.fileno())  # borrowed: detached below, never closed
    except (OSError, ValueError):  # the descriptor is already gone
        return Pending.CLOSING
    try:
        head = sock.recv(PEEK_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return Pending.NOTHING
    except OSError:  # the peer is gone
        return Pending.CLOSING
    finally:
        sock.detach()
    if head.startswith((b"GET ", b"HEAD ")) and b"\r\n\r\n" in head:
        return Pending.PROBE
    return Pending.OTHER if head else Pending.CLOSING  # b"": the peer closed its side


def _move(conn: object, source: dict[object, asyncio.BaseTransport],
          target: dict[object, asyncio.BaseTransport]) -> None:
    transport = source.pop(conn, None)
    if transport is not None:
        target[conn] = transport


def cap_connections(
    server: web.Server,
    ledger: ConnectionLedger,
    on_evict: Callable[[], None] | None = None,
    on_refuse: Callable[[], None] | None = None,
) -> ConnectionLedger:
    """At ``ledger.limit`` open connections, close one that has no complete request yet.

    A prober that opens connections and never finishes a request would otherwise take
    every file descriptor, and the next restart could not spawn its workers; refusing
    new connections instead (as before) let 64 idle ones lock the probes out. Closures
    are counted (``on_evict`` for an older connection, ``on_refuse`` for the new one when
    every other is busy), never logged one by one: an attacker must not fill the log.
    """
    made, lost, handle = server.connection_made, server.connection_lost, server.request_handler

    def connection_made(handler: RequestHandler, transport: asyncio.Transport) -> None:
        made(handler, transport)
        transport.set_protocol(_HeadersTap(handler, ledger.headers_read))
        victim = ledger.opened(handler, transport)
        if victim is None:
            return
        # closed on the next turn of the loop, once aiohttp has started the connection's
        # task: closing it now would run connection_lost first, and that task would die
        # on an assertion (one traceback per refused connection)
        asyncio.get_running_loop().call_soon(victim.close)
        counted = on_refuse if victim is transport else on_evict
        if counted is not None:
            counted()

    def connection_lost(handler: RequestHandler, exc: BaseException | None = None) -> None:
        ledger.closed(handler)
        lost(handler, exc)

    async def request_handler(request: web.BaseRequest) -> web.StreamResponse:
        ledger.request_started(request.protocol)
        try:
            return await handle(request)
        finally:
            ledger.request_done(request.protocol)

    server.connection_made = connection_made  # type: ignore[method-assign]
    server.connection_lost = connection_lost  # type: ignore[method-assign]
    server.request_handler = request_handler
    return ledger


class _HeadersTap(asyncio.Protocol):
    """Between a connection's transport and aiohttp's handler: tells the ledger as soon as a
    request's headers have been read, and whether it is a probe, before aiohttp gets round
    to handling it (a loop turn or two later), so a probe read is never closed for room in
    between, and a POST read is closed first."""

    def __init__(self, handler: RequestHandler, on_headers: Callable[[object, bool], None]
                 ) -> None:
        self._handler = handler
        self._on_headers = on_headers
        self._start = b""  # the first bytes of the request being read
        self._tail = b""  # the last bytes read: the blank line may span two reads

    def data_received(self, data: bytes) -> None:
        self._handler.data_received(data)
        if len(self._start) < len(b"HEAD "):
            self._start += data[: len(b"HEAD ")]
        seen, self._tail = self._tail + data[:3], data[-3:]
        if b"\r\n\r\n" in data or b"\r\n\r\n" in seen:
            self._on_headers(self._handler, self._start.startswith((b"GET ", b"HEAD ")))
            self._start = b""  # what follows is a body or the next request: either way

    def eof_received(self) -> None:
        self._handler.eof_received()  # None: the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        self._handler.connection_lost(exc)

    def pause_writing(self) -> None:
        self._handler.pause_writing()

    def resume_writing(self) -> None:
        self._handler.resume_writing()
