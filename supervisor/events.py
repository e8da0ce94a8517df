"""The JSON-lines event log: one object per state change, launch, exit, failure, restart.

Each line carries wall and monotonic timestamps, the run id and the attempt. The file is
opened for append (nothing from an earlier run is lost) and can be reopened on SIGHUP for
logrotate. Writes are small and line-buffered; a failing disk is logged, never fatal.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger(__name__)


class EventLog:
    """Appends one JSON object per line to ``path`` (or nowhere if ``path`` is None)."""

    def __init__(self, path: str | Path | None, run_id: str) -> None:
        self.path = Path(path) if path is not None else None
        self.run_id = run_id
        self.attempt = 0
        self.count = 0
        self._file: IO[str] | None = None
        self._open()

    def _open(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
            self._file = os.fdopen(fd, "a", buffering=1, encoding="utf-8")
        except OSError as exc:
            logger.error("cannot open event log %s: %s", self.path, exc)
            self._file = None

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Record one event; returns the object written."""
        record: dict[str, Any] = {
            "event": kind,
            "time": round(time.time(), 6),
            "mono": round(time.monotonic(), 6),
            "run_id": self.run_id,
            "attempt": self.attempt,
        }
        record.update({k: v for k, v in fields.items() if v is not None})
        self.count += 1
        if self._file is not None:
            try:
                self._file.write(json.dumps(record, default=str, separators=(",", ":")) + "\n")
            except OSError as exc:
                logger.error("cannot write event log %s: %s", self.path, exc)
        return record

    def reopen(self) -> None:
        """Close and open the file again (after logrotate moved it)."""
        self.close()
        self._open()

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
