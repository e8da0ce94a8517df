"""Pure logic behind worker output: torchrun's flags, per-stream routes, line splitting.

Nothing here touches a file descriptor or an event loop, so every rule (which stream goes
where, how a chunk of bytes becomes whole prefixed console lines, which lines a duplicate
filter keeps) is unit-tested on plain bytes. ``output.py`` does the I/O.

The rules follow torchrun 2.13 (``DefaultLogsSpecs.reify`` and ``TailLog``):

- ``--redirects``/``--tee`` are masks (1 stdout, 2 stderr, 3 both) per local rank; a teed
  stream is also written to its file.
- Only teed streams are copied to the console, each line prefixed (default
  ``[${role_name}${local_rank}]:``, no space). A stream that is neither redirected nor teed
  inherits the console untouched, without a prefix.
- ``--local-ranks-filter`` hides the other ranks from the console: their console-only
  streams go to ``/dev/null``, their teed streams go to their files only.
- ``--duplicate-{stdout,stderr}-filters`` copy the console lines (with their prefix) that
  contain any filter string to ``attempt_K/filtered_{stdout,stderr}.log``.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from string import Template
from typing import NamedTuple

import msgspec

OUT = 1  # torchrun's Std.OUT
ERR = 2  # torchrun's Std.ERR
STREAMS = (("stdout", OUT), ("stderr", ERR))

DEFAULT_PREFIX_TEMPLATE = "[${role_name}${local_rank}]:"
# Console lines longer than this are cut; every later piece of the same line carries the mark.
LINE_LIMIT = 64 * 1024
CONTINUATION_MARK = b"[cont] "


class OutputSpecError(ValueError):
    """A malformed ``--redirects``, ``--tee`` or ``--local-ranks-filter`` value."""


# ------------------------------------------------------------------ torchrun's flags


def parse_std_map(text: str, local_world_size: int, *, what: str) -> dict[int, int]:
    """``"3"`` or ``"0:1,1:3"`` -> {local_rank: 0..3} for every local rank.

    Ranks missing from a map get 0, as in torchrun's ``to_map``; unlike torchrun's regex,
    rank numbers may have any number of digits (``10:3``).
    """
    text = text.strip()
    if re.fullmatch(r"\d+", text):
        value = int(text)
        if value > 3:
            raise OutputSpecError(f"{what}: expected 0-3, got {text!r}")
        return dict.fromkeys(range(local_world_size), value)
    result = dict.fromkeys(range(local_world_size), 0)
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d+)\s*:\s*(\d+)", part)
        if not m or int(m.group(2)) > 3:
            raise OutputSpecError(f"{what}: expected 0-3 or RANK:0-3,..., got {text!r}")
        result[int(m.group(1))] = int(m.group(2))
    return result


def parse_ranks_filter(text: str) -> frozenset[int] | None:
    """``"0,2"`` -> {0, 2}; empty means every rank is shown (None)."""
    text = text.strip()
    if not text:
        return None
    try:
        ranks = frozenset(int(part) for part in text.split(","))
    except ValueError:
        raise OutputSpecError(
            f"local_ranks_filter: expected comma-separated ranks such as 0,1, got {text!r}"
        ) from None
    if any(rank < 0 for rank in ranks):
        raise OutputSpecError(f"local_ranks_filter: ranks cannot be negative, got {text!r}")
    return ranks


def render_prefix(
    template: str | None,
    *,
    role_name: str,
    rank: int,
    local_rank: int,
    hostname: str,
    restart_count: int,
) -> bytes:
    """The console prefix of one rank; unknown ``${names}`` stay as written (safe_substitute)."""
    text = Template(DEFAULT_PREFIX_TEMPLATE if template is None else template).safe_substitute(
        role_name=role_name, rank=rank, local_rank=local_rank, hostname=hostname,
        restart_count=restart_count,
    )
    return text.encode()


# ------------------------------------------------------------------ where a stream goes


class Target(enum.Enum):
    """What the worker's file descriptor 1 or 2 is."""

    INHERIT = "inherit"  # the supervisor's own stdout/stderr: zero overhead, no prefix
    DEVNULL = "devnull"  # hidden by --local-ranks-filter and not redirected
    PIPE = "pipe"  # read by the supervisor: file, and maybe a prefixed console copy


class StreamRoute(msgspec.Struct, frozen=True):
    """The route of one stream (stdout or stderr) of one local rank."""

    target: Target
    to_console: bool = False  # a prefixed copy of each line goes to the console

    @property
    def to_file(self) -> bool:
        return self.target is Target.PIPE


def route_stream(redirect: int, tee: int, shown: bool, bit: int) -> StreamRoute:
    """torchrun's rule for one stream: file if redirected or teed, console copy if teed."""
    if (redirect | tee) & bit:
        return StreamRoute(Target.PIPE, to_console=bool(tee & bit) and shown)
    return StreamRoute(Target.INHERIT if shown else Target.DEVNULL)


# ------------------------------------------------------------------ lines


class Piece(NamedTuple):
    """Whole console lines cut from a stream, each ending in ``\\n``.

    ``continued`` means the first line continues a line whose start was already emitted
    (it was longer than the limit); it gets the continuation mark after the prefix.
    """

    data: bytes
    continued: bool = False


class LineSplitter:
    """Turns arbitrary chunks of a stream into whole lines, holding at most ``limit`` bytes.

    A line without a newline is held until its newline arrives; past ``limit`` bytes it is
    cut (never inside a UTF-8 character when avoidable) so memory stays bounded whatever
    the worker writes. ``flush()`` at EOF releases a last line that has no newline.
    """

    def __init__(self, limit: int = LINE_LIMIT) -> None:
        if limit < 4:
            raise ValueError("limit must leave room for a UTF-8 character")
        self.limit = limit
        self._pending = bytearray()
        self._continued = False  # _pending continues a line already emitted in part

    @property
    def pending(self) -> int:
        """Bytes held back waiting for their newline."""
        return len(self._pending)

    def feed(self, chunk: bytes) -> list[Piece]:
        """Whole lines completed by ``chunk`` (usually one piece: a block of lines)."""
        pieces: list[Piece] = []
        last = chunk.rfind(b"\n")
        if last < 0:
            self._pending += chunk
            self._spill(pieces)
            return pieces
        start = 0
        if self._pending:
            start = chunk.find(b"\n") + 1
            self._pending += chunk[:start]
            self._emit(bytes(self._pending), self._continued, pieces)
            self._pending.clear()
        if start <= last:
            self._emit(chunk[start : last + 1], False, pieces)
        self._continued = False
        self._pending += chunk[last + 1 :]
        self._spill(pieces)
        return pieces

    def flush(self) -> list[Piece]:
        """At EOF: the last line without a newline, completed with one for the console."""
        if not self._pending:
            return []
        piece = Piece(bytes(self._pending) + b"\n", self._continued)
        self._pending.clear()
        self._continued = False
        return [piece]

    def _emit(self, block: bytes, continued: bool, pieces: list[Piece]) -> None:
        """Append a block of whole lines, cutting any line longer than the limit."""
        if len(block) <= self.limit:  # the fast path: no line can be too long
            pieces.append(Piece(block, continued))
            return
        group_start = pos = 0
        while pos < len(block):
            end = block.index(b"\n", pos) + 1
            if end - pos - 1 > self.limit:  # this line (without its newline) is too long
                if group_start < pos:
                    pieces.append(Piece(block[group_start:pos], continued))
                    continued = False
                self._cut_line(block[pos:end], continued, pieces)
                continued = False
                group_start = end
            pos = end
        if group_start < len(block):
            pieces.append(Piece(block[group_start:], continued))

    def _cut_line(self, line: bytes, continued: bool, pieces: list[Piece]) -> None:
        """Cut one over-long line (ending in its newline) into marked pieces."""
        rest = memoryview(line)
        while len(rest) - 1 > self.limit:
            cut = _utf8_cut(rest, self.limit)
            pieces.append(Piece(bytes(rest[:cut]) + b"\n", continued))
            rest = rest[cut:]
            continued = True
        pieces.append(Piece(bytes(rest), continued))

    def _spill(self, pieces: list[Piece]) -> None:
        """Emit held bytes past the limit as cut pieces, so the held part stays bounded."""
        while len(self._pending) > self.limit:
            cut = _utf8_cut(memoryview(self._pending), self.limit)
            pieces.append(Piece(bytes(self._pending[:cut]) + b"\n", self._continued))
            del self._pending[:cut]
            self._continued = True


def _utf8_cut(data: memoryview | bytes | bytearray, limit: int) -> int:
    """A cut position <= limit that does not split a UTF-8 sequence (if it can help it)."""
    cut = limit
    # a continuation byte (10xxxxxx) must not start the next piece; back off at most 3
    while cut > limit - 3 and (data[cut] & 0xC0) == 0x80:
        cut -= 1
    return cut if (data[cut] & 0xC0) != 0x80 else limit


def render(pieces: Iterable[Piece], prefix: bytes) -> bytes:
    """Console bytes for the pieces: every line starts with ``prefix``; one block."""
    out: list[bytes] = []
    for piece in pieces:
        head = prefix + CONTINUATION_MARK if piece.continued else prefix
        if prefix:
            # bytes.replace runs in C: one pass per block, not a Python loop per line
            body = piece.data[:-1].replace(b"\n", b"\n" + prefix)
            out.append(head + body + b"\n")
        else:
            out.append(head + piece.data)
    return b"".join(out)


def matching_lines(pieces: Iterable[Piece], needles: Sequence[bytes], prefix: bytes) -> bytes:
    """The rendered lines whose content contains any needle (torchrun's duplicate filters)."""
    out: list[bytes] = []
    for piece in pieces:
        if not any(needle in piece.data for needle in needles):
            continue  # the common case: one C-speed scan per block, no per-line work
        lines = piece.data[:-1].split(b"\n")
        for index, line in enumerate(lines):
            if any(needle in line for needle in needles):
                mark = CONTINUATION_MARK if index == 0 and piece.continued else b""
                out.append(prefix + mark + line + b"\n")
    return b"".join(out)
