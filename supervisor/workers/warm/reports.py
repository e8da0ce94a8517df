"""The standby's one report on its socket, parsed in one place.

``standby_main`` writes it (it runs apart from this package, so it writes the bytes by
hand): ``b"R"`` and the modules an auto preload could not import (ready), ``b"F"`` and
the error (failed: the standby is of no use), or ``b"FT"``, a package, a tab and the
error (``--preload auto``: that package read a per-attempt variable while it imported).
"""

from __future__ import annotations

import msgspec

READY = b"R"
FAILED = b"F"
TAINTED = "T"  # after FAILED: the package, a tab, then the error


class Ready(msgspec.Struct, frozen=True):
    """Started, and done preloading; ``skipped``: modules an auto preload could not import."""

    skipped: str = ""


class Failed(msgspec.Struct, frozen=True):
    """The preload failed (or the standby is gone): its worker must start cold."""

    message: str
    tainted: str | None = None  # the top-level package that read a per-attempt variable


Report = Ready | Failed


def parse(data: bytes) -> Report:
    """The report in ``data`` (empty: the standby exited before it reported)."""
    if not data:
        return Failed("the standby exited")
    text = data[1:].decode(errors="replace")
    if data.startswith(READY):
        return Ready(text)
    if not text:
        return Failed("preloading failed")
    if data.startswith(FAILED) and text.startswith(TAINTED):
        package, _, message = text[1:].partition("\t")
        return Failed(message, package)
    return Failed(text)
