"""Deadline FIFO wire format and the deadline table (pure: no I/O, no event loop).

Workers post one JSON object per line on the timer FIFO, in the format of torch's
``FileTimerClient``::

    {"version": 1, "pid": P, "scope_id": S, "expiration_time": T, "signal": N}

``expiration_time`` is wall-clock epoch seconds; a negative value releases the scope
(torch's client sends ``signal: 0`` with a release). ``parse_request`` validates one line
strictly and says why it rejects one, in a short reason usable as a metrics label.

``DeadlineTable`` keeps one deadline per ``(pid, scope)``. Deadlines are converted to the
monotonic clock on receipt, so a wall-clock step cannot fire or postpone them, and the
caller passes both clock readings in, so every decision is reproducible in a test.
"""

from __future__ import annotations

import enum
import heapq
import json
import math
from collections.abc import Iterator

import msgspec
import msgspec.structs

PIPE_BUF = 4096  # longest line (without its newline) a writer can post atomically
WIRE_VERSION = 1
MAX_SIGNAL = 64  # SIGRTMAX on Linux
MAX_PID = 2**22  # PID_MAX_LIMIT on 64-bit Linux
DEFAULT_MAX_SCOPES_PER_PID = 1024


class RejectReason(enum.StrEnum):
    """Why a request was dropped; the values are stable metrics labels."""

    OVERSIZED = "oversized"
    MALFORMED = "malformed"  # not UTF-8 JSON
    NOT_OBJECT = "not_object"
    MISSING_FIELD = "missing_field"
    BAD_TYPE = "bad_type"
    BAD_VERSION = "bad_version"
    BAD_PID = "bad_pid"
    BAD_EXPIRATION = "bad_expiration"
    BAD_SIGNAL = "bad_signal"
    TOO_MANY_SCOPES = "too_many_scopes"
    # decided by the tailer, which knows the processes
    SUPERVISOR_PID = "supervisor_pid"
    DEAD_PID = "dead_pid"
    NOT_OWNED = "not_owned"


class TimerRequest(msgspec.Struct, frozen=True):
    """One valid request from a worker: acquire (or renew) or release a deadline."""

    pid: int
    scope: str
    expiration_time: float  # wall clock, epoch seconds; negative releases the scope
    signal: int  # 1..64 for an acquire; 0..64 for a release (torch sends 0)

    @property
    def is_release(self) -> bool:
        return self.expiration_time < 0


class Rejected(msgspec.Struct, frozen=True):
    """A line that is not a valid request, with the reason (a metrics label) and detail."""

    reason: RejectReason
    detail: str = ""


_FIELDS: dict[str, type] = {
    "version": int,
    "pid": int,
    "scope_id": str,
    "expiration_time": float,
    "signal": int,
}


def parse_request(line: bytes) -> TimerRequest | Rejected:
    """Parse one line from the FIFO (with or without its trailing newline)."""
    if line.endswith(b"\n"):
        line = line[:-1]
    if len(line) > PIPE_BUF:
        return Rejected(RejectReason.OVERSIZED, f"{len(line)} bytes")
    try:
        obj = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        return Rejected(RejectReason.MALFORMED, str(exc)[:200])
    if not isinstance(obj, dict):
        return Rejected(RejectReason.NOT_OBJECT, type(obj).__name__)
    for name, kind in _FIELDS.items():
        if name not in obj:
            return Rejected(RejectReason.MISSING_FIELD, name)
        if not _has_type(obj[name], kind):
            return Rejected(RejectReason.BAD_TYPE, f"{name}: {type(obj[name]).__name__}")
    return _validate(obj["version"], obj["pid"], obj["scope_id"], obj["expiration_time"],
                     obj["signal"])


def _has_type(value: object, kind: type) -> bool:
    # bool is a subclass of int, but true is not a pid
    if isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, int | float)
    return isinstance(value, kind)


def _validate(
    version: int, pid: int, scope: str, expiration: float, signum: int
) -> TimerRequest | Rejected:
    if version != WIRE_VERSION:
        return Rejected(RejectReason.BAD_VERSION, str(version))
    if not 0 < pid <= MAX_PID:
        return Rejected(RejectReason.BAD_PID, str(pid))
    try:
        expiration = float(expiration)  # a huge JSON integer overflows here
    except OverflowError:
        expiration = math.inf
    if not math.isfinite(expiration):
        return Rejected(RejectReason.BAD_EXPIRATION, "not finite")
    lowest = 0 if expiration < 0 else 1
    if not lowest <= signum <= MAX_SIGNAL:
        return Rejected(RejectReason.BAD_SIGNAL, str(signum))
    return TimerRequest(pid, scope, expiration, signum)


def encode_request(request: TimerRequest) -> bytes:
    """The wire form of a request, newline included (what torch's client writes)."""
    obj = {
        "version": WIRE_VERSION,
        "pid": request.pid,
        "scope_id": request.scope,
        "expiration_time": request.expiration_time,
        "signal": request.signal,
    }
    return json.dumps(obj).encode() + b"\n"


# ------------------------------------------------------------------------------ table


class Deadline(msgspec.Struct, frozen=True):
    """A registered deadline; ``expires_at`` is monotonic seconds."""

    pid: int
    scope: str
    expires_at: float
    signal: int
    local_rank: int


class Expired(msgspec.Struct, frozen=True):
    """A deadline that passed; ``late`` is how long ago, when it was noticed."""

    deadline: Deadline
    late: float

    @property
    def pid(self) -> int:
        return self.deadline.pid


_Key = tuple[int, str]


class DeadlineTable:
    """Deadlines keyed by ``(pid, scope)``, ordered by expiry (monotonic clock).

    A min-heap gives the next deadline in O(log n); renewed and released entries leave
    stale heap items behind, skipped when they reach the top and purged when the heap
    grows to twice the live entries.
    """

    def __init__(self, max_scopes_per_pid: int = DEFAULT_MAX_SCOPES_PER_PID) -> None:
        self._max_scopes = max_scopes_per_pid
        self._live: dict[_Key, tuple[int, Deadline]] = {}  # key -> (generation, deadline)
        self._per_pid: dict[int, int] = {}
        self._heap: list[tuple[float, int, _Key]] = []
        self._generation = 0

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Deadline]:
        return iter(sorted((d for _, d in self._live.values()), key=lambda d: d.expires_at))

    def register(
        self, request: TimerRequest, local_rank: int, now_wall: float, now_mono: float
    ) -> Deadline | Rejected:
        """Add or renew the deadline of an acquire request; converts wall to monotonic."""
        key = (request.pid, request.scope)
        if key not in self._live and self._per_pid.get(request.pid, 0) >= self._max_scopes:
            return Rejected(RejectReason.TOO_MANY_SCOPES, str(request.pid))
        expires_at = now_mono + (request.expiration_time - now_wall)
        deadline = Deadline(request.pid, request.scope, expires_at, request.signal, local_rank)
        self._put(key, deadline)
        return deadline

    def release(self, pid: int, scope: str) -> bool:
        """Remove one deadline; returns whether it existed."""
        return self._remove((pid, scope))

    def next_deadline(self) -> float | None:
        """The earliest live deadline (monotonic), or None when there is none."""
        top = self._top()
        return top.expires_at if top is not None else None

    def pop_expired(self, now_mono: float) -> list[Expired]:
        """Deadlines that passed, at most one per pid (its earliest), earliest first.

        All deadlines of such a pid are removed: the worker is about to be signalled, and
        one hang is one failure however many of its scopes expired.
        """
        expired: list[Expired] = []
        while (top := self._top()) is not None and top.expires_at <= now_mono:
            expired.append(Expired(top, now_mono - top.expires_at))
            self.drop_pid(top.pid)
        return expired

    def postpone_until(self, at_least: float) -> int:
        """Move every deadline earlier than ``at_least`` (monotonic) to it; returns how many.

        Used after a stall of the supervisor's loop: time in which nothing could be
        observed (not even a renewal) must not count against the workers, so each one
        gets at least until ``at_least`` to be heard from again. Never shortens a deadline.
        """
        moved = [d for _, d in self._live.values() if d.expires_at < at_least]
        for deadline in moved:
            self._put((deadline.pid, deadline.scope),
                      msgspec.structs.replace(deadline, expires_at=at_least))
        return len(moved)

    def drop_pid(self, pid: int) -> int:
        """Remove every deadline of ``pid`` (it exited or is being stopped); returns how many."""
        keys = [key for key in self._live if key[0] == pid]
        for key in keys:
            self._remove(key)
        return len(keys)

    def clear(self) -> None:
        """Forget everything (the group stopped or a new attempt starts)."""
        self._live.clear()
        self._per_pid.clear()
        self._heap.clear()

    def _put(self, key: _Key, deadline: Deadline) -> None:
        if key not in self._live:
            self._per_pid[key[0]] = self._per_pid.get(key[0], 0) + 1
        self._generation += 1
        self._live[key] = (self._generation, deadline)
        heapq.heappush(self._heap, (deadline.expires_at, self._generation, key))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._compact()

    def _remove(self, key: _Key) -> bool:
        if self._live.pop(key, None) is None:
            return False
        left = self._per_pid[key[0]] - 1
        if left:
            self._per_pid[key[0]] = left
        else:
            del self._per_pid[key[0]]
        return True

    def _top(self) -> Deadline | None:
        while self._heap:
            _, generation, key = self._heap[0]
            entry = self._live.get(key)
            if entry is not None and entry[0] == generation:
                return entry[1]
            heapq.heappop(self._heap)  # renewed or released since it was pushed
        return None

    def _compact(self) -> None:
        self._heap = [(d.expires_at, gen, (d.pid, d.scope)) for gen, d in self._live.values()]
        heapq.heapify(self._heap)
