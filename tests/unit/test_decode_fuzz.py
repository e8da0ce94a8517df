"""Every value the supervisor reads from etcd goes through one decoder (``decode``).

Fuzzed with random bytes and random JSON shapes for every key it reads: the decoder (and
the ``State`` accessors and ``KeyValue.from_json`` built on it) returns a value of the
key's type, ignores it (None), or raises ``BadValue`` naming the key; nothing else, ever.
The values the supervisor itself writes decode to what was written.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.rendezvous.base import RendezvousError
from supervisor.rendezvous.etcd.keys import (
    Close,
    Keys,
    State,
    advance_txn,
    close_job_txn,
    close_round_txn,
    result_value,
)
from supervisor.rendezvous.etcd.wire import decode as dec
from supervisor.rendezvous.etcd.wire.client import EtcdError, KeyValue

KEYS = Keys("job")
SETTINGS = settings(max_examples=60, deadline=None)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=12,
)


def _field_values() -> st.SearchStrategy[Any]:
    """Objects with the real field names and random values: the shapes that get far."""
    names = sorted({n for s in dec.SCHEMAS.values() for n in s.type.__struct_fields__})
    return st.dictionaries(st.sampled_from(names), json_values, max_size=6)


def _encoded(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


raw_values = (st.binary(max_size=64) | json_values.map(_encoded)
              | _field_values().map(_encoded))


def _decode_any(kind: str, raw: bytes) -> object:
    schema = dec.SCHEMAS[kind]
    try:
        value = dec.decode(kind, "/k/" + kind, raw, schema.type)
    except dec.BadValue as exc:
        assert schema.on_bad is dec.OnBad.FAIL
        assert kind in str(exc) and "\n" not in str(exc)
        return exc
    if value is None:
        assert schema.on_bad is dec.OnBad.IGNORE
    else:
        assert isinstance(value, schema.type)
    return value


@pytest.mark.parametrize("kind", sorted(dec.SCHEMAS))
@SETTINGS
@given(raw=raw_values)
def test_every_key_decodes_or_is_rejected_by_its_rule(kind: str, raw: bytes) -> None:
    _decode_any(kind, raw)


@SETTINGS
@given(raw=raw_values)
def test_a_bad_closed_value_reads_as_closed_failed_naming_the_key(raw: bytes) -> None:
    value = dec.decode("ctl/closed", KEYS.closed, raw, dec.Closed)
    assert isinstance(value, dec.Closed)
    if dec.reason(raw, dec.SCHEMAS["ctl/closed"]) is not None:
        assert not value.ok and KEYS.closed in value.reason


def _kv(key: str, raw: bytes) -> KeyValue:
    return KeyValue(key, raw, create_revision=1, mod_revision=1)


@SETTINGS
@given(round_raw=raw_values, result_raw=raw_values, master_raw=raw_values,
       restarts_raw=raw_values, closed_raw=raw_values, join_raw=raw_values,
       node=st.text(max_size=8))
def test_state_accessors_raise_only_bad_value(
    round_raw: bytes, result_raw: bytes, master_raw: bytes, restarts_raw: bytes,
    closed_raw: bytes, join_raw: bytes, node: str,
) -> None:
    kvs = {k: _kv(k, v) for k, v in (
        (KEYS.round, round_raw), (KEYS.result(0), result_raw), (KEYS.master(0), master_raw),
        (KEYS.restarts, restarts_raw), (KEYS.closed, closed_raw),
        (KEYS.node(0, "join", node or "n"), join_raw))}
    state = State(KEYS, kvs)
    for read in (lambda: state.round, lambda: state.round_reason, lambda: state.closed,
                 lambda: state.members(0), lambda: state.master(0),
                 lambda: state.restarts, lambda: state.joins(0), lambda: state.shape):
        try:
            read()
        except dec.BadValue as exc:
            assert exc.key.startswith(KEYS.ctl)


@SETTINGS
@given(data=json_values | _field_values() | st.dictionaries(
    st.sampled_from(["key", "value", "create_revision", "mod_revision", "version", "lease"]),
    st.text(max_size=12) | st.integers() | st.binary(max_size=8).map(
        lambda b: base64.b64encode(b).decode()), max_size=6))
def test_key_value_from_json_raises_only_etcd_error(data: Any) -> None:
    try:
        kv = KeyValue.from_json(data)
    except EtcdError:
        return
    assert isinstance(kv.key, str) and isinstance(kv.value, bytes)
    assert all(-(1 << 63) <= n < 1 << 63 for n in (kv.mod_revision, kv.lease, kv.version))


def test_a_key_that_is_not_utf8_is_kept_under_a_name_state_skips() -> None:
    raw_key = (KEYS.node(0, "join") + "\xff").encode("latin-1")
    kv = KeyValue.from_json({"key": base64.b64encode(raw_key).decode(),
                             "value": base64.b64encode(b"{}").decode()})
    assert "\ufffd" in kv.key
    before = dec.IGNORED["nodes/join"]
    assert State(KEYS, {kv.key: kv}).nodes(0, "join") == {}
    assert dec.IGNORED["nodes/join"] == before + 1


def test_the_values_the_supervisor_writes_decode_to_what_was_written() -> None:
    joins = {f"n{i}": _kv(KEYS.node(0, "join", f"n{i}"), json.dumps(
        {"node": f"n{i}", "addr": "10.0.0.1", "local_world_size": 2}).encode())
        for i in range(3)}
    state = State(KEYS, {kv.key: kv for kv in joins.values()})
    _, ops = close_round_txn(state, Close(0, tuple(joins.values())), 5)
    written = base64.b64decode(ops[0]["request_put"]["value"])
    assert written == result_value([{"node": n, "local_world_size": 2} for n in joins]).encode()
    state = State(KEYS, {KEYS.result(0): _kv(KEYS.result(0), written)})
    assert [m.node for m in state.members(0) or []] == ["n0", "n1", "n2"]
    _, ops = advance_txn(State(KEYS, {}), "node(s) lost: n1", "n0")
    round_raw = base64.b64decode(ops[0]["request_put"]["value"])
    assert State(KEYS, {KEYS.round: _kv(KEYS.round, round_raw)}).round == 1
    _, ops = close_job_txn(KEYS, ok=False, reason="worker failed", node="n0")
    closed_raw = base64.b64decode(ops[0]["request_put"]["value"])
    closed = State(KEYS, {KEYS.closed: _kv(KEYS.closed, closed_raw)}).closed
    assert closed == dec.Closed(ok=False, reason="worker failed", node="n0")


@pytest.mark.parametrize(("raw", "why"), [
    (b'{"round": "x"}', "Expected `int`"),
    (b'{"round": -1}', ">= 0"),
    (b'{"round": 1e999}', ""),
    (b'{"round": 1, "reason": "' + b"x" * 5000 + b'"}', "length <= 4096"),
    (b'{"round": 1, "reason": "\xff"}', "UTF-8"),
    (b"[1]", "Expected `object`"),
])
def test_a_bad_round_names_the_key_in_one_line(raw: bytes, why: str) -> None:
    state = State(KEYS, {KEYS.round: _kv(KEYS.round, raw)})
    with pytest.raises(dec.BadValue) as caught:
        _ = state.round
    message = str(caught.value)
    assert isinstance(caught.value, RendezvousError)
    assert message.startswith(f"etcd key {KEYS.round} holds a malformed value")
    assert why in message and "\n" not in message and "\x1b" not in message


def test_reasons_are_kept_escaped_and_long_ones_are_bounded_by_the_writers() -> None:
    reason = "worker said \x1b]0;owned\x07\n" + "x" * 10_000
    _, ops = close_job_txn(KEYS, ok=False, reason=reason, node="n0")
    raw = base64.b64decode(ops[0]["request_put"]["value"])
    closed = State(KEYS, {KEYS.closed: _kv(KEYS.closed, raw)}).closed
    assert closed is not None and not closed.ok
    assert closed.reason.startswith("worker said \\x1b]0;owned\\x07\\x0a")
    assert KEYS.closed not in closed.reason  # decoded, not the bad-value reason


def test_a_closed_value_without_reason_closes_the_job_as_failed() -> None:
    state = State(KEYS, {KEYS.closed: _kv(KEYS.closed, b'{"ok": false}')})
    assert state.closed is not None and not state.closed.ok
    assert KEYS.closed in state.closed.reason


def test_a_join_value_for_another_node_is_ignored() -> None:
    key = KEYS.node(0, "join", "a")
    raw = msgspec.json.encode({"node": "b", "addr": "h", "local_world_size": 1})
    assert State(KEYS, {key: _kv(key, raw)}).nodes(0, "join") == {}
