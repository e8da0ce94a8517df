"""The one sanitiser of the command-line views (``core.untrusted``): numbers finite and
bounded, text printable and bounded, containers bounded, other types dropped."""

from __future__ import annotations

import json
import math

from supervisor.core.untrusted import (
    MAX_DEPTH,
    MAX_ITEMS,
    MAX_TEXT,
    as_dict,
    as_list,
    clean,
    sanitise,
    text,
)


def test_numbers_out_of_bounds_become_none() -> None:
    doc = json.loads('{"a": 1e999, "b": -1e999, "c": 1e300, "d": 12.5, "e": 1' + "0" * 22 + "}")
    assert sanitise(doc) == {"a": None, "b": None, "c": None, "d": 12.5, "e": None}
    assert sanitise(math.nan) is None
    assert sanitise(True) is True and sanitise(3) == 3


def test_strings_lose_their_control_characters_and_are_cut() -> None:
    assert sanitise("a\x1b[2Jb\x07\x9b\u202ec\nd") == "a?[2Jb???c\nd"
    cut = sanitise("x" * (MAX_TEXT + 10))
    assert isinstance(cut, str) and len(cut) == MAX_TEXT and cut.endswith("...")
    assert sanitise({"\x1bkey": 1}) == {"?key": 1}


def test_containers_are_bounded_in_length_and_depth() -> None:
    long = sanitise(list(range(MAX_ITEMS + 5)))
    assert isinstance(long, list) and len(long) == MAX_ITEMS
    deep: object = "bottom"
    for _ in range(MAX_DEPTH + 5):
        deep = [deep]
    assert "bottom" not in json.dumps(sanitise(deep))
    assert sanitise({1, 2}) is None and sanitise(b"bytes") is None


def test_a_field_of_the_wrong_type_reads_as_absent() -> None:
    assert as_dict("boom") == {} and as_dict({"a": 1}) == {"a": 1}
    assert as_list("abc") == [] and as_list([1]) == [1]


def test_text_is_one_bounded_printable_line() -> None:
    assert text("a\nb\x1b", 10) == "a b?"
    assert text(ValueError("x" * 50), 10) == "xxxxxxx..."
    assert clean("ok\n") == "ok\n"
