"""The deadline FIFO: created private, opened so it never blocks, read when readable.

torch's server opens its FIFO read-only and blocking: it blocks until the first worker
opens it, then sees EOF whenever the last writer closes and has to poll. Here the reader
opens it ``O_RDWR | O_NONBLOCK``: being a writer itself it never sees EOF, and it reads
only when the event loop says the FIFO is readable. The FIFO lives in a directory only
the supervisor's user can enter (0700, FIFO 0600), so no other user can post requests.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio

from supervisor.core.deadlines import PIPE_BUF

logger = logging.getLogger(__name__)

DIR_MODE = 0o700
FIFO_MODE = 0o600
_READ_CHUNK = 65536
_MAX_CHUNKS_PER_WAKEUP = 1  # a pipe's default capacity: split into lines at one go, no more


class FifoError(Exception):
    """The FIFO or its directory cannot be made safely (wrong type, owner or mode)."""


# ------------------------------------------------------------------------- framing


class LineBuffer:
    """Splits a byte stream into lines, holding at most ``max_line`` bytes.

    A half-written line is kept until its newline arrives. A line longer than
    ``max_line`` (newline excluded) is dropped as soon as it is known to be too long and
    counted once; the rest of it is discarded up to the next newline, where framing
    resumes.
    """

    def __init__(self, max_line: int = PIPE_BUF) -> None:
        self._max_line = max_line
        self._partial = bytearray()
        self._discarding = False

    @property
    def pending(self) -> int:
        """Bytes of an incomplete line held."""
        return len(self._partial)

    def feed(self, data: bytes) -> tuple[list[bytes], int]:
        """Add bytes; return the completed lines (without newline) and how many were dropped."""
        lines: list[bytes] = []
        dropped = 0
        start = 0
        while start < len(data):
            end = data.find(b"\n", start)
            piece = data[start:] if end < 0 else data[start:end]
            dropped += self._take(piece, complete=end >= 0, lines=lines)
            start = len(data) if end < 0 else end + 1
        return lines, dropped

    def _take(self, piece: bytes, *, complete: bool, lines: list[bytes]) -> int:
        dropped = 0
        if not self._discarding:
            if len(self._partial) + len(piece) > self._max_line:
                self._partial.clear()
                self._discarding = True
                dropped = 1
            else:
                self._partial += piece
        if complete:
            if not self._discarding and self._partial:
                lines.append(bytes(self._partial))
            self._partial.clear()
            self._discarding = False
        return dropped


# ------------------------------------------------------------------------ the FIFO


def ensure_private_dir(directory: Path) -> bool:
    """Make ``directory`` (0700) or check an existing one is private; returns if created.

    An existing directory must be a real directory (not a symlink), owned by our
    effective user and closed to group and others; anything else raises ``FifoError``.
    """
    try:
        os.mkdir(directory, DIR_MODE)
    except FileExistsError:
        _check_private_dir(directory)
        return False
    os.chmod(directory, DIR_MODE)  # mkdir's mode is filtered by the umask
    return True


def _check_private_dir(directory: Path) -> None:
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise FifoError(f"{directory} exists and is not a directory")
    if st.st_uid != os.geteuid():
        raise FifoError(f"{directory} is owned by uid {st.st_uid}, not by us")
    if st.st_mode & 0o077:
        raise FifoError(f"{directory} is open to other users (mode {st.st_mode & 0o777:o})")


def check_fifo_path(path: Path) -> None:
    """Raise ``FifoError`` now if ``create_fifo`` would refuse ``path`` (a start-up check).

    Makes the private parent directory if it is missing, as ``create_fifo`` would.
    """
    try:
        ensure_private_dir(path.parent)
        st = os.lstat(path)
    except FileNotFoundError as exc:
        if exc.filename == str(path):
            return
        raise FifoError(f"{path.parent}: {exc.strerror}") from None
    except OSError as exc:
        raise FifoError(f"{path.parent}: {exc.strerror}") from None
    if not stat.S_ISFIFO(st.st_mode):
        raise FifoError(f"{path} exists and is not a FIFO; refusing to replace it")


def create_fifo(path: Path) -> bool:
    """Create the FIFO (0600) in a private parent directory; returns if the dir was created.

    A stale FIFO left by an earlier run is replaced; any other file at ``path`` is
    refused rather than deleted.
    """
    created_dir = ensure_private_dir(path.parent)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISFIFO(st.st_mode):
            raise FifoError(f"{path} exists and is not a FIFO; refusing to replace it")
        os.unlink(path)
    os.mkfifo(path, FIFO_MODE)
    os.chmod(path, FIFO_MODE)
    return created_dir


def open_fifo(path: Path) -> int:
    """Open the FIFO for reading without ever blocking or seeing EOF."""
    flags = os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(path, flags)
    if not stat.S_ISFIFO(os.fstat(fd).st_mode):
        os.close(fd)
        raise FifoError(f"{path} is not a FIFO")
    return fd


@dataclass
class Batch:
    """What one wake-up read: complete lines, and how many oversized lines were dropped."""

    lines: list[bytes]
    oversized: int


class FifoReader:
    """An open deadline FIFO. Use ``open_fifo_reader`` to create, open and clean it up."""

    def __init__(self, path: Path, fd: int, max_line: int = PIPE_BUF) -> None:
        self.path = path
        self._fd = fd
        self._buffer = LineBuffer(max_line)

    @property
    def fileno(self) -> int:
        return self._fd

    async def receive(self) -> Batch:
        """Wait until the FIFO is readable, then return what arrived (may be no line yet)."""
        while True:
            await anyio.wait_readable(self._fd)
            data = self._drain()
            if data:
                lines, oversized = self._buffer.feed(data)
                return Batch(lines, oversized)

    def read_now(self) -> Batch:
        """What the FIFO holds right now, without waiting (an empty batch if nothing).

        The deadline timer calls this before it judges: after a stall of the loop the
        readiness callback may not have run yet, while renewals sit unread in the FIFO.
        """
        lines, oversized = self._buffer.feed(self._drain())
        return Batch(lines, oversized)

    def _drain(self) -> bytes:
        chunks: list[bytes] = []
        for _ in range(_MAX_CHUNKS_PER_WAKEUP):
            try:
                chunk = os.read(self._fd, _READ_CHUNK)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                raise
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


@asynccontextmanager
async def open_fifo_reader(path: Path, max_line: int = PIPE_BUF) -> AsyncIterator[FifoReader]:
    """Create the FIFO at ``path`` (private parent dir), open it, and remove it on exit."""
    created_dir = create_fifo(path)
    fd = open_fifo(path)
    inode = os.fstat(fd).st_ino
    logger.info("deadline FIFO open at %s", path)
    try:
        yield FifoReader(path, fd, max_line)
    finally:
        os.close(fd)
        _remove_fifo(path, inode, created_dir)


def _remove_fifo(path: Path, inode: int, created_dir: bool) -> None:
    try:
        if os.lstat(path).st_ino == inode:  # not a FIFO someone made after us
            os.unlink(path)
        if created_dir:
            os.rmdir(path.parent)
    except OSError as exc:
        logger.debug("could not remove %s: %s", path, exc)
