"""Values from elsewhere made safe to show: the one sanitiser of the command-line views.

``elastic-supervisor status`` shows a document a supervisor served (or anything that
answered at the URL a runtime directory named), the job view and ``node list`` show what
any node wrote to etcd. Each value passes ``sanitise`` before it is formatted: numbers
finite and bounded, strings without control characters and bounded, containers bounded
in length and depth, every other type dropped. The formatters then only check which of
the JSON types they got (``as_dict``, ``as_list``), never that a number is finite or a
string printable.
"""

from __future__ import annotations

import math
import re
from typing import Any

MAX_TEXT = 4096  # characters of one string
MAX_ITEMS = 10_000  # entries of one list or object
MAX_DEPTH = 16  # nesting: a status document is 4 deep
MAX_NUMBER = 1e15  # seconds (31 million years), counts, epochs: any real value fits
# Control characters (C0 but newline, DEL, C1) and bidi overrides: what could move the
# cursor, clear the screen, retitle the terminal or reorder what is shown.
_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")

Json = dict[str, Any] | list[Any] | str | int | float | bool | None


def clean(text: str) -> str:
    """``text`` with every control character but newline shown as ``?``."""
    return _CONTROL.sub("?", text)


def text(value: object, limit: int = MAX_TEXT) -> str:
    """``value`` as one printable line of at most ``limit`` characters."""
    shown = clean(value if isinstance(value, str) else str(value)).replace("\n", " ")
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def sanitise(value: object, depth: int = 0) -> Json:
    """``value`` (as ``json.loads`` or msgspec made it) with every part bounded and
    printable; what is out of bounds becomes None (a number) or is cut (text, items)."""
    match value:
        case bool() | None:
            return value
        case int():
            return value if abs(value) <= MAX_NUMBER else None
        case float():
            return value if math.isfinite(value) and abs(value) <= MAX_NUMBER else None
        case str():
            return _bounded(clean(value))
        case dict() if depth < MAX_DEPTH:
            return {_bounded(clean(str(k)), 256): sanitise(v, depth + 1)
                    for k, v in list(value.items())[:MAX_ITEMS]}
        case list() | tuple() if depth < MAX_DEPTH:
            return [sanitise(v, depth + 1) for v in value[:MAX_ITEMS]]
    return None


def as_dict(value: object) -> dict[str, Any]:
    """``value`` if it is an object, else an empty one: a field of the wrong type is absent."""
    return value if isinstance(value, dict) else {}


def as_list(value: object) -> list[Any]:
    """``value`` if it is a list, else an empty one."""
    return value if isinstance(value, list) else []


def _bounded(value: str, limit: int = MAX_TEXT) -> str:
    return value if len(value) <= limit else value[: limit - 3] + "..."
