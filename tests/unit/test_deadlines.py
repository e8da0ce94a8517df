"""Pure tests of the deadline wire format and the deadline table (no event loop)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.core.deadlines import (
    PIPE_BUF,
    DeadlineTable,
    Rejected,
    RejectReason,
    TimerRequest,
    encode_request,
    parse_request,
)

WALL = 1_700_000_000.0  # an epoch reading
MONO = 500.0  # a monotonic reading taken at the same instant


def line(**overrides: Any) -> bytes:
    obj: dict[str, Any] = {
        "version": 1,
        "pid": 1234,
        "scope_id": "train.py#42",
        "expiration_time": WALL + 10.0,
        "signal": 9,
    }
    for key, value in overrides.items():
        if value is ...:
            del obj[key]
        else:
            obj[key] = value
    return json.dumps(obj).encode() + b"\n"


def reason(raw: bytes) -> RejectReason:
    result = parse_request(raw)
    assert isinstance(result, Rejected), result
    return result.reason


# ----------------------------------------------------------------------------- parsing


def test_parses_torch_file_timer_client_line() -> None:
    # exactly what FileTimerRequest.to_json() produces (json.dumps, default separators)
    raw = b'{"version": 1, "pid": 77, "scope_id": "s", "expiration_time": 1.5, "signal": 9}\n'
    assert parse_request(raw) == TimerRequest(77, "s", 1.5, 9)


def test_torch_release_with_signal_zero_is_a_release() -> None:
    request = parse_request(line(expiration_time=-1, signal=0))
    assert isinstance(request, TimerRequest)
    assert request.is_release


def test_integer_expiration_is_accepted_as_float() -> None:
    request = parse_request(line(expiration_time=int(WALL) + 5))
    assert isinstance(request, TimerRequest)
    assert request.expiration_time == int(WALL) + 5


def test_unknown_extra_fields_are_ignored() -> None:
    assert isinstance(parse_request(line(extra="x")), TimerRequest)


def test_line_without_newline_parses() -> None:
    assert isinstance(parse_request(line().rstrip(b"\n")), TimerRequest)


def test_roundtrip_through_encode() -> None:
    request = TimerRequest(5, "a\"b\n", WALL, 15)
    assert parse_request(encode_request(request)) == request


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"not json", RejectReason.MALFORMED),
        (b"\xff\xfe{}", RejectReason.MALFORMED),
        (b"", RejectReason.MALFORMED),
        (b"[1, 2]", RejectReason.NOT_OBJECT),
        (b"42", RejectReason.NOT_OBJECT),
        (b"[" * 100_000, RejectReason.OVERSIZED),
        (b"[" * 4000, RejectReason.MALFORMED),
        (line(pid=...), RejectReason.MISSING_FIELD),
        (line(scope_id=...), RejectReason.MISSING_FIELD),
        (line(signal=...), RejectReason.MISSING_FIELD),
        (line(version=...), RejectReason.MISSING_FIELD),
        (line(expiration_time=...), RejectReason.MISSING_FIELD),
        (line(pid=True), RejectReason.BAD_TYPE),
        (line(signal=True), RejectReason.BAD_TYPE),
        (line(version=True), RejectReason.BAD_TYPE),
        (line(expiration_time=False), RejectReason.BAD_TYPE),
        (line(pid="1234"), RejectReason.BAD_TYPE),
        (line(pid=12.0), RejectReason.BAD_TYPE),
        (line(scope_id=7), RejectReason.BAD_TYPE),
        (line(expiration_time="soon"), RejectReason.BAD_TYPE),
        (line(signal=9.0), RejectReason.BAD_TYPE),
        (line(pid=None), RejectReason.BAD_TYPE),
        (line(version=2), RejectReason.BAD_VERSION),
        (line(version=0), RejectReason.BAD_VERSION),
        (line(pid=0), RejectReason.BAD_PID),
        (line(pid=-5), RejectReason.BAD_PID),
        (line(pid=2**40), RejectReason.BAD_PID),
        (line(signal=0), RejectReason.BAD_SIGNAL),
        (line(signal=65), RejectReason.BAD_SIGNAL),
        (line(signal=-9), RejectReason.BAD_SIGNAL),
        (line(expiration_time=-1, signal=65), RejectReason.BAD_SIGNAL),
        (line(expiration_time=math.inf), RejectReason.BAD_EXPIRATION),
        (line(expiration_time=math.nan), RejectReason.BAD_EXPIRATION),
        (line(expiration_time=10**400), RejectReason.BAD_EXPIRATION),
    ],
)
def test_rejects_with_reason(raw: bytes, expected: RejectReason) -> None:
    assert reason(raw) is expected


def test_oversized_line_is_rejected_even_if_valid_json() -> None:
    raw = line(scope_id="x" * PIPE_BUF)
    assert reason(raw) is RejectReason.OVERSIZED


def test_line_of_exactly_pipe_buf_bytes_is_accepted() -> None:
    base = len(line(scope_id="")) - 1
    raw = line(scope_id="x" * (PIPE_BUF - base))
    assert len(raw) == PIPE_BUF + 1  # newline excluded from the limit
    assert isinstance(parse_request(raw), TimerRequest)


def test_reject_reasons_are_label_strings() -> None:
    assert {r.value for r in RejectReason} >= {"malformed", "oversized", "not_owned"}
    assert all(r.value.isidentifier() for r in RejectReason)


# ------------------------------------------------------------------------------- table


def acquire(pid: int = 10, scope: str = "s", after: float = 5.0, signal: int = 9) -> TimerRequest:
    return TimerRequest(pid, scope, WALL + after, signal)


def test_register_converts_wall_clock_to_monotonic() -> None:
    table = DeadlineTable()
    deadline = table.register(acquire(after=7.5), 0, WALL, MONO)
    assert not isinstance(deadline, Rejected)
    assert deadline.expires_at == pytest.approx(MONO + 7.5)
    assert table.next_deadline() == pytest.approx(MONO + 7.5)


def test_empty_table_has_no_deadline() -> None:
    table = DeadlineTable()
    assert table.next_deadline() is None
    assert table.pop_expired(math.inf) == []


def test_renewing_a_scope_replaces_its_deadline() -> None:
    table = DeadlineTable()
    table.register(acquire(after=5), 0, WALL, MONO)
    table.register(acquire(after=50), 0, WALL, MONO)
    assert len(table) == 1
    assert table.next_deadline() == pytest.approx(MONO + 50)
    assert table.pop_expired(MONO + 10) == []


def test_renewing_to_an_earlier_time_moves_it_forward() -> None:
    table = DeadlineTable()
    table.register(acquire(after=50), 0, WALL, MONO)
    table.register(acquire(after=5), 0, WALL, MONO)
    assert table.next_deadline() == pytest.approx(MONO + 5)


def test_release_removes_the_deadline() -> None:
    table = DeadlineTable()
    table.register(acquire(), 0, WALL, MONO)
    assert table.release(10, "s")
    assert table.next_deadline() is None
    assert table.pop_expired(MONO + 100) == []


def test_release_of_unknown_scope_is_harmless() -> None:
    table = DeadlineTable()
    table.register(acquire(scope="a"), 0, WALL, MONO)
    assert not table.release(10, "b")
    assert not table.release(11, "a")
    assert len(table) == 1


def test_same_scope_of_two_pids_is_two_deadlines() -> None:
    table = DeadlineTable()
    table.register(acquire(pid=1), 0, WALL, MONO)
    table.register(acquire(pid=2), 1, WALL, MONO)
    assert len(table) == 2


def test_deadline_in_the_past_expires_at_once() -> None:
    table = DeadlineTable()
    table.register(acquire(after=-3), 2, WALL, MONO)
    [expired] = table.pop_expired(MONO)
    assert expired.late == pytest.approx(3)
    assert expired.deadline.local_rank == 2


def test_pop_expired_is_ordered_and_leaves_future_ones() -> None:
    table = DeadlineTable()
    table.register(acquire(pid=1, after=3), 0, WALL, MONO)
    table.register(acquire(pid=2, after=1), 1, WALL, MONO)
    table.register(acquire(pid=3, after=100), 2, WALL, MONO)
    expired = table.pop_expired(MONO + 5)
    assert [e.pid for e in expired] == [2, 1]
    assert [e.late for e in expired] == pytest.approx([4, 2])
    assert table.next_deadline() == pytest.approx(MONO + 100)


def test_deadline_is_not_expired_before_its_time() -> None:
    table = DeadlineTable()
    table.register(acquire(after=1), 0, WALL, MONO)
    assert table.pop_expired(MONO + 0.999) == []
    assert len(table.pop_expired(MONO + 1)) == 1


def test_one_expiry_per_pid_and_its_other_scopes_are_dropped() -> None:
    table = DeadlineTable()
    table.register(acquire(scope="a", after=2, signal=15), 0, WALL, MONO)
    table.register(acquire(scope="b", after=1, signal=9), 0, WALL, MONO)
    table.register(acquire(scope="c", after=100), 0, WALL, MONO)
    [expired] = table.pop_expired(MONO + 3)
    assert expired.deadline.scope == "b"
    assert expired.deadline.signal == 9
    assert len(table) == 0


def test_drop_pid_forgets_only_that_pid() -> None:
    table = DeadlineTable()
    table.register(acquire(pid=1, scope="a"), 0, WALL, MONO)
    table.register(acquire(pid=1, scope="b"), 0, WALL, MONO)
    table.register(acquire(pid=2, scope="a", after=9), 1, WALL, MONO)
    assert table.drop_pid(1) == 2
    assert [d.pid for d in table] == [2]
    assert table.next_deadline() == pytest.approx(MONO + 9)


def test_clear_forgets_everything() -> None:
    table = DeadlineTable()
    for pid in range(1, 5):
        table.register(acquire(pid=pid), 0, WALL, MONO)
    table.clear()
    assert len(table) == 0
    assert table.next_deadline() is None


def test_too_many_scopes_per_pid_is_rejected() -> None:
    table = DeadlineTable(max_scopes_per_pid=2)
    table.register(acquire(scope="a"), 0, WALL, MONO)
    table.register(acquire(scope="b"), 0, WALL, MONO)
    result = table.register(acquire(scope="c"), 0, WALL, MONO)
    assert isinstance(result, Rejected)
    assert result.reason is RejectReason.TOO_MANY_SCOPES
    # renewing an existing scope and other pids are still fine
    assert not isinstance(table.register(acquire(scope="a", after=9), 0, WALL, MONO), Rejected)
    assert not isinstance(table.register(acquire(pid=11), 0, WALL, MONO), Rejected)


def test_many_renewals_keep_the_heap_bounded() -> None:
    table = DeadlineTable()
    for i in range(10_000):
        table.register(acquire(after=float(i)), 0, WALL, MONO)
    assert len(table._heap) <= 2 * len(table) + 65
    assert table.next_deadline() == pytest.approx(MONO + 9_999)


# Property: the table agrees with a naive dict model under any sequence of operations.
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("register"), st.integers(1, 4), st.sampled_from("abc"),
                  st.floats(-5, 50, allow_nan=False)),
        st.tuples(st.just("release"), st.integers(1, 4), st.sampled_from("abc"), st.just(0.0)),
        st.tuples(st.just("drop"), st.integers(1, 4), st.just(""), st.just(0.0)),
        st.tuples(st.just("pop"), st.just(0), st.just(""), st.floats(0, 50, allow_nan=False)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(_ops)
def test_table_matches_naive_model(ops: list[tuple[str, int, str, float]]) -> None:
    table = DeadlineTable()
    model: dict[tuple[int, str], float] = {}
    for op, pid, scope, value in ops:
        if op == "register":
            table.register(TimerRequest(pid, scope, WALL + value, 9), 0, WALL, MONO)
            model[(pid, scope)] = MONO + ((WALL + value) - WALL)
        elif op == "release":
            table.release(pid, scope)
            model.pop((pid, scope), None)
        elif op == "drop":
            table.drop_pid(pid)
            model = {k: v for k, v in model.items() if k[0] != pid}
        else:
            now = MONO + value
            got = {(e.pid, e.deadline.scope) for e in table.pop_expired(now)}
            due: dict[int, tuple[float, str]] = {}
            for (p, s), t in model.items():
                if t <= now and (p not in due or (t, s) < due[p]):
                    due[p] = (t, s)
            assert {p for p, _ in got} == set(due)
            model = {k: v for k, v in model.items() if k[0] not in due}
        expected_next = min(model.values(), default=None)
        assert table.next_deadline() == expected_next
        assert len(table) == len(model)
