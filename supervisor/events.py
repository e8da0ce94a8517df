"""The JSON-lines event log: one object per state change, launch, exit, failure, restart.

Each line carries wall and monotonic timestamps, the run id and the attempt. The file is
opened for append (nothing from an earlier run is lost) and can be reopened on SIGHUP for
logrotate. A failing disk is never fatal, and never loses events silently:

- A line that cannot be written (ENOSPC, EDQUOT, EIO) is kept in memory, in order, with
  the part of a torn line still to write, and retried before the next event is written,
  by ``retry_pending`` (a task, only awake while something is pending) and at ``close``.
- At most ``MAX_PENDING`` lines (and ``MAX_PENDING_BYTES``) are kept; later events are
  dropped and counted (``dropped``). When writing works again the kept lines go out
  first, then one ``events_dropped`` record saying how many events are missing at that
  point and why, so the file itself shows the gap.
- ``dropped`` and ``pending`` are exported as metrics (``Metrics.watch_event_log``) and
  ``loss_summary()`` gives the end-of-job summary its line.

String fields are capped at ``MAX_MESSAGE_CHARS`` (4 096) characters, with a marker: a
root cause can carry a worker's error-file message of up to 1 MiB, which belongs in the
error file (its path is in the event), not once per failure in this log.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from anyio.abc import TaskStatus

from supervisor.core.statusview import cap_text
from supervisor.safepaths import open_below

logger = logging.getLogger(__name__)

MAX_PENDING = 1024  # events kept in memory while the file cannot be written
MAX_PENDING_BYTES = 1 << 20  # and at most this many bytes of them
RETRY_INTERVAL = 1.0  # seconds between retries while events are pending


class EventLog:
    """Appends one JSON object per line to ``path`` (or nowhere if ``path`` is None)."""

    def __init__(self, path: str | Path | None, run_id: str, *,
                 root: Path | None = None) -> None:
        """``root``: the log directory ``path`` is below (nothing below it is followed
        through a symlink: ``safepaths``); None: the file's own directory."""
        self.path = Path(path) if path is not None else None
        self.root = root
        self.run_id = run_id
        self.attempt = 0
        self.count = 0
        self.dropped = 0  # events lost for good (the buffer was full)
        self._fd = -1
        self._pending: collections.deque[bytes] = collections.deque()
        self._pending_bytes = 0
        self._unreported = 0  # dropped events not yet announced in the file
        self._error = ""  # why writing fails now, "" while it works
        self._retry: anyio.Event | None = None  # retry_pending waits on it while healthy
        self._closed = False  # by close(): a reopen still in its thread then keeps nothing
        self._open()

    @property
    def pending(self) -> int:
        """Events held in memory, waiting for the file to take them."""
        return len(self._pending)

    def _open(self) -> None:
        if self.path is None:
            return
        try:
            self._fd = self._open_fd()
        except OSError as exc:
            if not self._error:
                logger.error("cannot open event log %s: %s", self.path, exc)
            self._failed(exc)
            self._fd = -1

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Record one event; returns the object written (or kept, or dropped)."""
        record: dict[str, Any] = {
            "event": kind,
            "time": round(time.time(), 6),
            "mono": round(time.monotonic(), 6),
            "run_id": self.run_id,
            "attempt": self.attempt,
        }
        record.update({k: cap_text(v) if isinstance(v, str) else v
                       for k, v in fields.items() if v is not None})
        self.count += 1
        if self.path is not None:
            if self._pending:  # space may have returned: make room before keeping this one
                self.flush()
            self._keep(_encode(record))
            self.flush()
        return record

    def flush(self) -> bool:
        """Write what is pending; returns True when nothing is left pending."""
        if self.path is None:
            return True
        if self._fd < 0:
            self._open()  # it could not be created (no inode left?): try again
            if self._fd < 0:
                return False
        while self._pending:
            if not self._write_head():
                return False
            if not self._pending and self._unreported:
                self._report_dropped()
        if self._error:
            logger.warning("event log %s writable again; %d event(s) were lost meanwhile",
                           self.path, self.dropped)
            self._error = ""
        return True

    def _keep(self, line: bytes) -> None:
        full = (len(self._pending) >= MAX_PENDING
                or self._pending_bytes + len(line) > MAX_PENDING_BYTES)
        if full:
            self.dropped += 1
            self._unreported += 1
            return
        if self._unreported:  # the gap is here, before this line: say so at this place
            self._report_dropped()
        self._pending.append(line)
        self._pending_bytes += len(line)

    def _write_head(self) -> bool:
        """Write the first pending line (or what is left of it); False if it failed."""
        line = self._pending[0]
        try:
            written = os.write(self._fd, line)
        except OSError as exc:
            self._failed(exc)
            return False
        self._pending_bytes -= written
        if written < len(line):  # a torn line: the rest goes first next time
            self._pending[0] = line[written:]
            return True
        self._pending.popleft()
        return True

    def _report_dropped(self) -> None:
        record = {"event": "events_dropped", "time": round(time.time(), 6),
                  "mono": round(time.monotonic(), 6), "run_id": self.run_id,
                  "attempt": self.attempt, "count": self._unreported,
                  "reason": self._error or "write failed"}
        self._unreported = 0
        line = _encode(record)
        self._pending.append(line)
        self._pending_bytes += len(line)

    def _failed(self, exc: OSError) -> None:
        if not self._error and self._fd >= 0:
            logger.error("cannot write event log %s: %s (keeping up to %d events in memory, "
                         "then counting what is dropped)", self.path, exc, MAX_PENDING)
        self._error = exc.strerror or str(exc)
        if self._retry is not None:
            self._retry.set()

    async def retry_pending(
        self, interval: float = RETRY_INTERVAL, *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run forever: while events are pending, retry writing them every ``interval``.

        Waits on an event while the file is healthy, so an idle supervisor pays nothing.
        Retrying at an interval is the point here: the kernel announces no free space.
        """
        task_status.started()
        while True:
            if self.flush():
                self._retry = anyio.Event()
                await self._retry.wait()
            else:
                await anyio.sleep(interval)

    def loss_summary(self) -> str | None:
        """One line for the end-of-job summary if events were lost or are still pending."""
        if not self.dropped and not self._pending:
            return None
        why = f" ({self._error})" if self._error else ""
        return (f"event log {self.path}: {self.dropped} event(s) lost, "
                f"{len(self._pending)} not written{why}")

    def _open_fd(self) -> int:
        """The file, opened for append: never through a symlink, never blocking on a FIFO
        a worker planted there (refused, as anything but a regular file: ``safepaths``)."""
        assert self.path is not None
        return open_below(self.root or self.path.parent, self.path, create_dirs=True)

    async def reopen(self) -> None:
        """Open the file again (after logrotate moved it) and write there from now on;
        keeps what is pending. The open runs in a worker thread (the file system may
        block); if it fails, the old file goes on being written, as for the rank logs."""
        if self.path is None:
            return
        try:
            fd = await anyio.to_thread.run_sync(self._open_fd)
        except OSError as exc:
            if self._fd < 0:  # no file to go on with: kept in memory and retried
                self._failed(exc)
            logger.warning("cannot reopen event log %s: %s; %s", self.path, exc,
                           "still writing the old file" if self._fd >= 0 else
                           "keeping events in memory")
            return
        if self._closed:
            os.close(fd)
            return
        self._close_fd()
        self._fd = fd
        self.flush()

    def close(self) -> None:
        """Write what is pending (a last try), then close; says what could not be written."""
        self.flush()
        summary = self.loss_summary()
        if summary is not None:
            logger.error("%s", summary)
        self._close_fd()
        self._closed = True

    def _close_fd(self) -> None:
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError as exc:
                logger.debug("closing event log %s: %s", self.path, exc)
            self._fd = -1


def _encode(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, default=str, separators=(",", ":")) + "\n").encode()
