""""Did you mean" for a mistyped flag or setting name. Pure logic: no I/O."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

# difflib's ratio a near-miss must reach: `nprocs_per_node` -> `nproc_per_node` is 0.97,
# `max_restart` -> `max_restarts` 0.96; unrelated names of this length stay below 0.6
CUTOFF = 0.6
# names this much less close than the closest are not offered: `max_restart` is 0.69 from
# `no_warm_restart`, which would only distract from `max_restarts`
MARGIN = 0.1


def closest(word: str, known: Iterable[str], *, most: int = 3) -> list[str]:
    """Up to ``most`` names of ``known`` closest to ``word``, best first: those about as
    close as the closest one."""
    scored = sorted(((difflib.SequenceMatcher(None, word, name).ratio(), name)
                     for name in set(known)), key=lambda pair: (-pair[0], pair[1]))
    if not scored or scored[0][0] < CUTOFF:
        return []
    best = scored[0][0]
    return [name for ratio, name in scored[:most] if ratio >= max(CUTOFF, best - MARGIN)]


def did_you_mean(word: str, known: Iterable[str], *, prefix: str = "") -> str:
    """``"; did you mean X?"`` (or ``X or Y``) with ``prefix`` before each name, or ""
    when nothing is close."""
    names = [f"{prefix}{name}" for name in closest(word, known)]
    if not names:
        return ""
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
    return f"; did you mean {listed}?"
