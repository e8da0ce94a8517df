"""Every value the supervisor reads from etcd, validated in one place.

etcd is shared state that every node of the job can write (and, on an open c10d host,
anyone who reaches it): nothing read from it is trusted. Each key the supervisor reads has
a row in ``SCHEMAS``: the msgspec ``Struct`` its JSON value must decode to (types, bounds,
UTF-8, printable text), the largest value accepted, and what a bad value means:

- ``FAIL``: the job cannot go on safely on a value it cannot read (``ctl/round``, a
  round's result, its master, the restart counter). ``decode`` raises ``BadValue``, a
  ``RendezvousError`` whose one line names the key; the node fails the job (and closes it
  for the others, which then stop with the same reason).
- ``IGNORE``: the value belongs to one node and the rest of the job is safe without it (a
  join key, a status summary). ``decode`` returns None and the key is counted in
  ``IGNORED`` and logged once.
- ``CLOSED``: ``ctl/closed`` exists, so the job is over whatever it says (no round can
  be opened past it): a bad value reads as "closed, failed" with a reason naming the key.

The shape of the gateway's own JSON (base64 keys and values, int64 revisions) is checked
here too (``gateway_kv``), for ``client.KeyValue.from_json``.

To read a new key: define its ``Struct`` (field types with ``Meta`` bounds; a
``__post_init__`` for cross-field rules), add a ``Schema`` row, and call
``decode(KIND, key, raw)``; ``tests/unit/test_decode_fuzz.py`` fuzzes every row.
"""

from __future__ import annotations

import base64
import contextlib
import enum
import logging
import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar
from urllib.parse import urlsplit

import msgspec

from supervisor.core import nodehealth as nh
from supervisor.errors import RendezvousError
from supervisor.rendezvous.etcd.wire.jobstep import PersistMark, WireReport, WireStep

logger = logging.getLogger(__name__)

MAX_TEXT = 4096  # characters of a reason or a failure message
MAX_NODES = 100_000  # members of one round
MAX_LOCAL_WORLD = 1 << 16
MAX_COUNT = 1 << 53  # a counter (restarts, rounds): exact in every JSON reader

# Printable text: no control characters (C0, DEL, C1) and no bidi overrides, which could
# rewrite a terminal or a log line when shown.
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")

Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
NodeId = Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern=r"^[^/]+$")]
Host = Annotated[str, msgspec.Meta(min_length=1, max_length=253, pattern=r"^[^/\s\\]+$")]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
LocalWorld = Annotated[int, msgspec.Meta(ge=1, le=MAX_LOCAL_WORLD)]


def printable(text: str) -> bool:
    """Whether ``text`` holds no control character or bidi override."""
    return _UNPRINTABLE.search(text) is None


def _require_printable(*texts: str) -> None:
    for text in texts:
        if not printable(text):
            raise ValueError("text holds control characters")


class Round(msgspec.Struct, frozen=True):
    """``ctl/round``: the current round and why it was opened. Reasons are free text
    (a failure's message may hold anything): bounded here, escaped by ``State``."""

    round: Count
    reason: Text = ""
    node: Text = ""


class Result(msgspec.Struct, frozen=True):
    """``ctl/result/N``: the members of round N in group-rank order, their local world
    sizes (one number when all are equal)."""

    nodes: Annotated[list[NodeId], msgspec.Meta(min_length=1, max_length=MAX_NODES)]
    sizes: LocalWorld | list[LocalWorld]
    snap: WireStep | None = None  # the step every rank restores (etcd.wire.jobstep)

    def __post_init__(self) -> None:
        _require_printable(*self.nodes)
        if isinstance(self.sizes, list) and len(self.sizes) != len(self.nodes):
            raise ValueError("sizes and nodes differ in length")
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError("a node is listed twice")

    def size_list(self) -> list[int]:
        return self.sizes if isinstance(self.sizes, list) else [self.sizes] * len(self.nodes)


class Master(msgspec.Struct, frozen=True):
    """``ctl/master/N``: where round N's rank-0 worker serves the store."""

    addr: Host
    port: Port

    def __post_init__(self) -> None:
        _require_printable(self.addr)


class Restarts(msgspec.Struct, frozen=True):
    """``ctl/restarts``: the job-wide failure restart counter."""

    count: Count
    last: Text = ""
    node: Text = ""


class Closed(msgspec.Struct, frozen=True):
    """``ctl/closed``: the job is over for everyone, and why (free text, as ``Round``)."""

    ok: bool
    reason: Text
    node: Text = ""


class Shape(msgspec.Struct, frozen=True):
    """``ctl/shape``: the job's ``--nnodes`` and ``--nproc-per-node``, recorded by the first
    node to arrive (``sameid``: two jobs under one run id)."""

    nnodes: Annotated[str, msgspec.Meta(max_length=32, pattern=r"^[0-9]+:[0-9]+$")]
    nproc_per_node: LocalWorld | None = None


class Join(msgspec.Struct, frozen=True):
    """``nodes/N/join/<node>``: a node joined round N."""

    node: NodeId
    addr: Annotated[str, msgspec.Meta(max_length=253)]
    local_world_size: LocalWorld
    snap: WireReport | None = None  # the snapshots it holds (etcd.wire.jobstep)

    def __post_init__(self) -> None:
        _require_printable(self.node, self.addr)


_Number = Annotated[float, msgspec.Meta(ge=0, le=1e12)]  # seconds or wall-clock epoch
_Short = Annotated[str, msgspec.Meta(max_length=256)]
_Rank = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]


class Goodput(msgspec.Struct, frozen=True):
    """A summary's goodput: closed totals and the open segment (see ``summary``)."""

    startup: _Number
    productive: _Number
    idle: _Number
    since: _Number
    started: _Number
    lost: Annotated[dict[_Short, _Number], msgspec.Meta(max_length=32)] = {}
    failures: _Rank = 0
    segment: _Short = ""
    cause: _Short | None = None
    ended: _Number | None = None


class Summary(msgspec.Struct, frozen=True):
    """``/elastic-supervisor-status/<run>/<node>``: one node's row of the job-wide view.
    Cells are bounded and printable; the health URL is ``http(s)://HOST:PORT`` (a peer
    fetches it and posts leave notices to it: ``peer_health_url`` also checks the host)."""

    node_id: _Short
    node_rank: _Rank | None = None
    host: _Short | None = None
    state: _Short | None = None
    attempt: _Rank | None = None
    restarts: _Rank | None = None
    max_restarts: _Rank | None = None
    world_size: _Rank | None = None
    health_url: Annotated[str, msgspec.Meta(max_length=512)] | None = None
    last_failure: Annotated[str, msgspec.Meta(max_length=1024)] | None = None
    goodput: Goodput | None = None

    def __post_init__(self) -> None:
        _require_printable(self.node_id, *(t for t in (self.host, self.state,
                                                       self.last_failure) if t is not None))
        if self.health_url is not None and health_url_host(self.health_url) is None:
            raise ValueError("health_url is not http(s)://HOST:PORT")


def health_url_host(url: str) -> str | None:
    """The host of ``url`` if it is ``http(s)://HOST:PORT`` and nothing more (no user, path,
    query, fragment or control character), else None."""
    if not printable(url) or any(c.isspace() for c in url) or len(url) > 300:
        return None
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if (parts.scheme not in ("http", "https") or not parts.hostname or port is None
            or parts.username is not None or parts.path or parts.query or parts.fragment
            or url.endswith(("?", "#"))):
        return None
    return parts.hostname


def peer_health_url(url: str | None, member_addr: str | None) -> str | None:
    """``url`` if it is a health URL (``health_url_host``) on ``member_addr``, the address
    that member advertised when it joined the round: a summary in etcd can never make this
    node fetch, or post to, another host."""
    if url is None or not member_addr:
        return None
    host = health_url_host(url)
    wanted = member_addr.strip("[]").lower()
    return url if host is not None and host.lower() == wanted else None


class OnBad(enum.Enum):
    """What a value that does not decode means (see the module docstring)."""

    FAIL = "fail the job"
    IGNORE = "ignore and count"
    CLOSED = "job closed, failed"


@dataclass(frozen=True)
class Schema:
    """How one kind of key is read: its value's type, size bound and bad-value rule."""

    type: type[msgspec.Struct]
    max_bytes: int
    on_bad: OnBad
    check: Callable[[Any], None] | None = None  # rules a Struct of core/ cannot hold


def _short_text(*texts: str, limit: int = nh.MAX_TEXT) -> None:
    """Node ids, reasons and descriptions of the healing records: printable, bounded (the
    writers cut them at ``nh.MAX_TEXT``), so that ``/status`` and ``node list`` stay small."""
    for text in texts:
        if len(text) > limit:
            raise ValueError(f"a text of {len(text)} characters, at most {limit}")
    _require_printable(*texts)


def _check_failure(f: nh.NodeFailure | nh.RoundCause) -> None:
    _short_text(f.description, f.signature.kind)


def _check_cause(cause: nh.RoundCause) -> None:
    _short_text(cause.node, cause.member)
    _check_failure(cause)


def _check_record(record: nh.NodeRecord) -> None:
    if not node_part_ok(record.node):
        raise ValueError("node is not a node id")
    _short_text(record.member)
    if len(record.failures) > nh.MAX_KEPT_FAILURES:
        raise ValueError(f"{len(record.failures)} failures, at most {nh.MAX_KEPT_FAILURES}")
    for failure in record.failures:
        _check_failure(failure)
    if record.quarantined is not None:
        _short_text(record.quarantined.reason)


# key kind -> schema. Keys read only for their presence or lease (ctl/leader,
# nodes/N/wait/<node>, nodes/N/done/<node>) have no value to decode.
SCHEMAS: dict[str, Schema] = {
    "ctl/round": Schema(Round, 16 << 10, OnBad.FAIL),
    "ctl/result": Schema(Result, 8 << 20, OnBad.FAIL),
    "ctl/master": Schema(Master, 1 << 10, OnBad.FAIL),
    "ctl/restarts": Schema(Restarts, 16 << 10, OnBad.FAIL),
    "ctl/closed": Schema(Closed, 16 << 10, OnBad.CLOSED),
    "ctl/shape": Schema(Shape, 1 << 10, OnBad.IGNORE),  # advisory: no verdict from it
    "nodes/join": Schema(Join, 4 << 10, OnBad.IGNORE),
    # snapshots: a bad mark persists nothing until the next one (etcd.wire.jobstep)
    "ctl/persist": Schema(PersistMark, 1 << 10, OnBad.IGNORE),
    "status": Schema(Summary, 8 << 10, OnBad.IGNORE),
    # healing (rendezvous/etcd/node_records.py): a bad cause or record is one node's claim
    # about itself; the job is safe without it (the node counts as having none)
    "ctl/cause": Schema(nh.RoundCause, 16 << 10, OnBad.IGNORE, _check_cause),
    "health": Schema(nh.NodeRecord, 64 << 10, OnBad.IGNORE, _check_record),
}

IGNORED: Counter[str] = Counter()  # key kind -> bad values ignored (this process)
_reported: set[tuple[str, int]] = set()  # (key, mod revision) logged already
_REPORT_LIMIT = 1000


class BadValue(RendezvousError):
    """A value read from etcd that the supervisor cannot use; the message names the key."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"etcd key {shown(key)} holds a malformed value ({why})")
        self.key = key


S = TypeVar("S", bound=msgspec.Struct)


def shown(text: str, limit: int = 200) -> str:
    """``text`` safe to put in one log line: control characters escaped, bounded."""
    safe = _UNPRINTABLE.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    return safe if len(safe) <= limit else safe[: limit - 3] + "..."


def bounded(text: str) -> str:
    """A reason as the writers store it: within ``MAX_TEXT``, so that it decodes."""
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 3] + "..."


def reason(raw: bytes, schema: Schema) -> str | None:
    """Why ``raw`` is not a value of ``schema`` (None: it is)."""
    try:
        _decode(raw, schema)
    except ValueError as exc:
        return str(exc)
    return None


def _decode(raw: bytes, schema: Schema) -> msgspec.Struct:
    if len(raw) > schema.max_bytes:
        raise ValueError(f"{len(raw)} bytes, at most {schema.max_bytes}")
    try:
        value = msgspec.json.decode(raw, type=schema.type)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(shown(str(exc), 120)) from None
    _check_floats(value)
    if schema.check is not None:
        schema.check(value)
    return value


def _check_floats(value: Any) -> None:
    """msgspec takes no NaN or infinity from JSON, but a huge exponent reads as inf."""
    for name in value.__struct_fields__:
        field = getattr(value, name)
        if isinstance(field, float) and not math.isfinite(field):
            raise ValueError(f"{name} is not finite")
        if isinstance(field, msgspec.Struct):
            _check_floats(field)


def decode(kind: str, key: str, raw: bytes, expect: type[S], *, report: bool = True
           ) -> S | None:
    """The value of ``key`` (of ``kind``, a row of ``SCHEMAS``), or per the row's rule:
    raise ``BadValue`` (FAIL), None after counting it (IGNORE), or a failed ``Closed``
    (CLOSED). ``report=False``: an ignored value is neither logged nor counted here (a
    command that counts it itself, such as ``status``)."""
    schema = SCHEMAS[kind]
    assert schema.type is expect, (kind, expect)
    try:
        value = _decode(raw, schema)
    except ValueError as exc:
        if not report and schema.on_bad is OnBad.IGNORE:
            return None
        return _bad(kind, key, schema, str(exc), expect)
    assert isinstance(value, expect)
    return value


def _bad(kind: str, key: str, schema: Schema, why: str, expect: type[S]) -> S | None:
    if schema.on_bad is OnBad.FAIL:
        raise BadValue(key, why)
    if schema.on_bad is OnBad.CLOSED:
        closed = Closed(ok=False, reason=str(BadValue(key, why)))
        assert isinstance(closed, expect)
        return closed
    count_ignored(kind, key, why)
    return None


def count_ignored(kind: str, key: str, why: str, revision: int = 0) -> None:
    """Count one ignored key and log it once (per key and revision, bounded)."""
    IGNORED[kind] += 1
    seen = (key, revision)
    if seen in _reported or len(_reported) >= _REPORT_LIMIT:
        return
    _reported.add(seen)
    logger.warning("ignoring etcd key %s: %s", shown(key), why)


# ---------------------------------------------------------------- the gateway's JSON


class WireError(ValueError):
    """etcd's gateway answered JSON that is not what etcd sends (``client`` turns it
    into an ``EtcdError``)."""


_INT64 = 1 << 63


def gateway_kv(data: object) -> tuple[str, bytes, int, int, int, int]:
    """(key, value, create_revision, mod_revision, version, lease) of one key-value of the
    gateway's JSON (base64 key and value, int64 fields as strings)."""
    if not isinstance(data, dict):
        raise WireError("a key-value that is not an object")
    return (key_text(_unb64(data.get("key", ""))), _unb64(data.get("value", "")),
            _int64(data, "create_revision"), _int64(data, "mod_revision"),
            _int64(data, "version"), _int64(data, "lease"))


def gateway_list(items: object) -> list[dict[str, Any]]:
    """A list of JSON objects (``kvs``, watch ``events``)."""
    if not isinstance(items, list | tuple) or not all(isinstance(i, dict) for i in items):
        raise WireError("a list of key-values that is not one")
    return list(items)


def _unb64(text: object) -> bytes:
    if not isinstance(text, str):
        raise WireError("a key or value that is not base64 text")
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:  # binascii.Error
        raise WireError("a key or value that is not base64") from None


def _int64(data: dict[str, Any], name: str) -> int:
    raw = data.get(name, 0)
    value: int | None = None
    if isinstance(raw, int) and not isinstance(raw, bool):
        value = raw
    elif isinstance(raw, str) and raw.isascii():
        with contextlib.suppress(ValueError):
            value = int(raw)
    if value is None or not -_INT64 <= value < _INT64:
        raise WireError(f"a key-value whose {name} is not an int64")
    return value


def key_text(raw: bytes) -> str:
    """An etcd key as text. A key that is not UTF-8 is no key the supervisor writes: it
    keeps a name (invalid bytes as U+FFFD) that matches none of ours and that ``State``
    skips, so one stray key can neither crash a watch nor stand for a node."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return raw.decode(errors="replace")


def node_part_ok(text: str) -> bool:
    """Whether the ``<node>`` part of a per-node key is a node id the job can use."""
    return 0 < len(text) <= 256 and printable(text) and "\ufffd" not in text and "/" not in text
