"""Reading the error files torch's ``@record`` writes to ``TORCHELASTIC_ERROR_FILE``."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import msgspec

MAX_ERROR_FILE = 1 << 20  # a larger file is read only this far


class ErrorReport(msgspec.Struct, frozen=True):
    message: str
    traceback: str = ""
    timestamp: float | None = None

    @property
    def summary(self) -> str:
        """The last line of the message: usually the exception type and text."""
        lines = [ln for ln in self.message.strip().splitlines() if ln.strip()]
        return lines[-1].strip() if lines else ""


def parse_error_file(data: Any) -> ErrorReport | None:
    """Both torch formats: ``{"message": {"message", "extraInfo": {"py_callstack",
    "timestamp"}}}`` and ``{"message": ..., "timestamp": ...}``."""
    if not isinstance(data, dict) or "message" not in data:
        return None
    inner = data["message"]
    if isinstance(inner, dict):
        raw_extra = inner.get("extraInfo")
        extra: dict[str, Any] = raw_extra if isinstance(raw_extra, dict) else {}
        return ErrorReport(
            message=str(inner.get("message", "")),
            traceback=str(extra.get("py_callstack", "")),
            timestamp=_number(extra.get("timestamp")),
        )
    return ErrorReport(message=str(inner), timestamp=_number(data.get("timestamp")))


def _number(value: Any) -> float | None:
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError, OverflowError):  # float(10**400) overflows
        return None


def read_error_file(path: str | Path) -> ErrorReport | None:
    """The report in ``path``, or None if missing, unreadable or not one of torch's
    formats; see ``read_error_data`` for what is refused and why."""
    return parse_error_file(read_error_data(path))


def read_error_data(path: str | Path) -> Any:
    """The JSON value in ``path``, or None if missing, not a regular file or unreadable.

    Never raises and never blocks: the worker chose what is at ``path``. A FIFO there must
    not stop the event loop, deep nesting must not escape as RecursionError, and nothing
    is followed through a symlink: a worker that links ``error.json`` to another file
    (a secret the supervisor's uid can read) must not get that file's text shown as the
    failure message in ``/status``. Devices and FIFOs are refused before they are opened
    (``lstat``), and the opened file is checked again (``fstat``: the same regular file),
    so a swap between the two checks is refused too.
    """
    try:
        seen = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(seen.st_mode):
        return None
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError:  # ELOOP: a symlink swapped in since the lstat
        return None
    try:
        with open(fd, encoding="utf-8", errors="replace") as f:  # owns fd from here
            if not _same_regular_file(os.fstat(fd), seen):
                return None
            text = f.read(MAX_ERROR_FILE)
        return json.loads(text)
    except (OSError, ValueError, RecursionError):
        return None


def _same_regular_file(opened: os.stat_result, seen: os.stat_result) -> bool:
    return stat.S_ISREG(opened.st_mode) and (opened.st_dev, opened.st_ino) == (
        seen.st_dev, seen.st_ino
    )
