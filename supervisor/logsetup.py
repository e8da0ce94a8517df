"""Logging for the daemon: journald-aware text, timestamped text, or JSON lines.

Under systemd, stderr is a stream to journald and ``$JOURNAL_STREAM`` names it as
``DEVICE:INODE``. When our stream is that very file, lines carry an sd-daemon(3)
priority prefix (``<6>``) instead of a timestamp: journald stamps each entry itself and
turns the prefix into the entry's PRIORITY, so ``journalctl -p warning`` works.
The stream is compared by ``fstat`` because the variable is inherited: a process whose
stderr was redirected elsewhere must not emit prefixes into a file.

``reopen()`` re-opens a log file after logrotate moved it; the daemon calls it on SIGHUP
(``systemctl reload``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Literal, TextIO

logger = logging.getLogger(__name__)

LogFormat = Literal["auto", "text", "json"]

TEXT_FORMAT: Final = "%(asctime)s %(levelname)-8s %(name)s: %(message)s"
JOURNAL_FORMAT: Final = "%(name)s: %(message)s"

# Attributes every LogRecord has; anything else came from ``extra=`` and goes into JSON.
_RECORD_ATTRS: Final = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}

_OURS: Final = "_elastic_supervisor_handler"  # marks handlers configure_logging installed


def syslog_priority(levelno: int) -> int:
    """sd-daemon.h priority for a logging level: DEBUG 7, INFO 6, WARNING 4, ERROR 3,
    CRITICAL 2 (levels in between round down to the more severe neighbour's number)."""
    if levelno >= logging.CRITICAL:
        return 2
    if levelno >= logging.ERROR:
        return 3
    if levelno >= logging.WARNING:
        return 4
    if levelno >= logging.INFO:
        return 6
    return 7


def stream_is_journal(stream: TextIO, environ: Mapping[str, str] | None = None) -> bool:
    """True when ``stream`` is the journald stream named by ``$JOURNAL_STREAM``."""
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    dev, sep, ino = value.partition(":")
    if not sep:
        return False
    try:
        st = os.fstat(stream.fileno())
        return (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (OSError, ValueError, AttributeError):
        # no real file descriptor behind the stream (StringIO, pytest capture), or junk
        return False


class JournalFormatter(logging.Formatter):
    """``<N>logger: message`` with no timestamp; every line of a traceback is prefixed
    too, since journald makes each line its own entry and would log it at INFO."""

    def __init__(self) -> None:
        super().__init__(JOURNAL_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{syslog_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in super().format(record).split("\n"))


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, ISO 8601), level, logger, message, exc and any
    ``extra=`` fields. With ``journal=True`` the line starts with ``<N>``, which journald
    strips, so the stored MESSAGE is still pure JSON."""

    def __init__(self, *, journal: bool = False) -> None:
        super().__init__()
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        line = json.dumps(self._fields(record), ensure_ascii=False, default=str)
        return f"<{syslog_priority(record.levelno)}>{line}" if self.journal else line

    def _fields(self, record: logging.LogRecord) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            fields["stack"] = self.formatStack(record.stack_info)
        extras = {k: v for k, v in record.__dict__.items() if k not in _RECORD_ATTRS}
        fields.update((k, v) for k, v in extras.items() if k not in fields)
        return fields


class ReopenableFileHandler(logging.FileHandler):
    """A file handler that ``reopen()`` points at a fresh file after rotation."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path, mode="a", encoding="utf-8")

    def reopen(self) -> None:
        """Close the current file and open the path again (logrotate's postrotate)."""
        with self.lock:  # type: ignore[union-attr]  # always set by Handler.__init__
            if self.stream is not None:
                self.stream.flush()
                self.stream.close()
            # FileHandler.emit opens the path itself while the stream is None, so a
            # failed open here retries on the next record instead of losing the handler.
            self.stream = None
            self.stream = self._open()


def parse_level(level: str) -> int:
    """``"info"``, ``"WARNING"``... to a logging level; ValueError if unknown."""
    value = logging.getLevelName(level.strip().upper())
    if not isinstance(value, int):
        raise ValueError(f"unknown log level {level!r}")
    return value


def make_formatter(fmt: LogFormat, *, journal: bool) -> logging.Formatter:
    """``auto`` is journal text on the journal stream and timestamped text elsewhere;
    ``text`` always has timestamps; ``json`` gets the priority prefix on the journal."""
    if fmt == "json":
        return JsonFormatter(journal=journal)
    if fmt == "auto" and journal:
        return JournalFormatter()
    if fmt in ("auto", "text"):
        return logging.Formatter(TEXT_FORMAT)
    raise ValueError(f"unknown log format {fmt!r}")


def configure_logging(
    level: str,
    fmt: LogFormat = "auto",
    stream: TextIO | None = None,
    *,
    log_file: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> logging.Handler:
    """Install the root handler; returns it. Calling again replaces the previous one.

    Logs go to ``stream`` (stderr by default), or to ``log_file`` when given (a file is
    never the journal, so ``auto`` means timestamped text there). Raises ValueError for
    an unknown level or format: call it while validating configuration.
    """
    levelno = parse_level(level)
    handler: logging.Handler
    if log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handler = ReopenableFileHandler(log_file)
        journal = False
    else:
        out = sys.stderr if stream is None else stream
        handler = logging.StreamHandler(out)
        journal = stream_is_journal(out, environ)
    handler.setFormatter(make_formatter(fmt, journal=journal))
    setattr(handler, _OURS, True)
    root = logging.getLogger()
    _remove_ours(root)
    root.addHandler(handler)
    root.setLevel(levelno)
    return handler


def reopen() -> int:
    """Re-open every log file configure_logging installed; returns how many.

    Call on SIGHUP. A file that cannot be opened is reported and retried on the next
    record; the other handlers are still reopened.
    """
    count = 0
    for handler in logging.getLogger().handlers:
        if not isinstance(handler, ReopenableFileHandler):
            continue
        try:
            handler.reopen()
        except OSError as exc:
            # Not via logging: the handler that failed may be the only destination.
            sys.stderr.write(f"elastic-supervisor: cannot reopen {handler.baseFilename}: {exc}\n")
            continue
        count += 1
    if count:
        logger.info("reopened %d log file(s)", count)
    return count


def _remove_ours(root: logging.Logger) -> None:
    for handler in list(root.handlers):
        if getattr(handler, _OURS, False):
            root.removeHandler(handler)
            handler.close()
