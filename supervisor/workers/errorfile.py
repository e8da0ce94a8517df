"""Reading the error files torch's ``@record`` writes to ``TORCHELASTIC_ERROR_FILE``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_ERROR_FILE = 1 << 20  # a larger file is read only this far


@dataclass(frozen=True)
class ErrorReport:
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
    except (TypeError, ValueError):
        return None


def read_error_file(path: str | Path) -> ErrorReport | None:
    """The report in ``path``, or None if missing or unreadable (never raises)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(MAX_ERROR_FILE)
        return parse_error_file(json.loads(text))
    except (OSError, ValueError):
        return None
