"""Worker output through the supervisor: per-rank log files, prefixed console copies.

A stream that is redirected or teed (``--redirects``/``--tee``, torchrun's values) goes
into a pipe; one *pump* per pipe copies it:

- to ``LOG_DIR/RUN_ID/attempt_K/LOCAL_RANK/{stdout,stderr}.log``: raw chunks, written as
  read, complete and in order (files need no line splitting);
- if teed and the rank passes ``--local-ranks-filter``: whole lines, each with the rank's
  prefix, to the supervisor's own stdout/stderr (the *console*), and the lines matching
  ``--duplicate-*-filters`` to ``attempt_K/filtered_{stdout,stderr}.log``.

A stream that is neither redirected nor teed inherits the console directly, as torchrun
does (no prefix, no overhead), or goes to ``/dev/null`` when the ranks filter hides it.
See ``logs.py`` for the rules and the line splitting.

Why it reads in bursts, writes whole blocks, holds a worker back instead of buffering,
and how rotation, draining and the line limit work: docs/design.md ("Worker output").
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import socket
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import msgspec
from anyio.abc import TaskGroup, TaskStatus

from supervisor.safepaths import open_below
from supervisor.workers.logs import (
    ERR,
    OUT,
    STREAMS,
    LineSplitter,
    OutputSpecError,
    Piece,
    StreamRoute,
    Target,
    matching_lines,
    parse_ranks_filter,
    parse_std_map,
    render,
    render_prefix,
    route_stream,
)

if TYPE_CHECKING:
    from supervisor.config import Settings

__all__ = ["OutputLoss", "OutputPlan", "OutputSpecError", "parse_std_map"]

logger = logging.getLogger(__name__)

CHUNK = 64 * 1024  # bytes per read(): large reads keep the per-byte cost in C
PIPE_SIZE = 1024 * 1024  # what a pipe holds while its pump pauses (F_SETPIPE_SZ, best effort)
COALESCE = 0.01  # seconds a pump pauses after a burst: caps wakeups, not throughput
MAX_READS = 32  # reads per burst before yielding, so one flood cannot starve the loop
DRAIN_TIMEOUT = 2.0  # seconds to wait for EOF once an attempt's workers are dead
DRAIN_MAX = 30.0  # the wait ends then even while a descendant keeps writing
STOP_TIMEOUT = 1.0  # then seconds to write out what was read before giving up
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


# ------------------------------------------------------------------ sinks


LossListener = Callable[[str, dict[str, Any]], object]  # what it returns is ignored
"""Told ``(event, fields)`` when output starts being lost and when the loss is known:
``("output_write_failed", {file, error})`` and ``("output_lost", {file, bytes, resumed})``.
The composition root passes them on to the event log."""


@dataclass
class OutputLoss:
    """Worker output that could not be written to its log files, over the whole run.

    Kept by the output plan from its start (``Metrics.watch_output`` exports it later).
    """

    lost_bytes: int = 0
    write_errors: int = 0  # failed writes (one per chunk that could not be written whole)
    listeners: list[LossListener] = field(default_factory=list)

    def tell(self, event: str, **fields: Any) -> None:
        for listener in self.listeners:
            try:
                listener(event, fields)
            except Exception:  # a reporting bug must not stop the output
                logger.exception("output loss listener failed")


class LogFile:
    """A raw log file, appended to with whole chunks; ``reopen()`` follows logrotate.

    A chunk that cannot be written (disk full, quota, I/O error) is dropped, never
    buffered (the worker must not block on a full log disk), but counted: in ``loss``
    (metrics), through its listeners (events), and in the file itself: when writing
    works again, a marker line says how many bytes are missing at that point.
    """

    def __init__(self, path: Path, loss: OutputLoss | None = None, *,
                 root: Path | None = None) -> None:
        """``root``: the log directory ``path`` is below; nothing below it is followed
        through a symlink, at the first open and at every ``reopen`` (``safepaths``)."""
        self.path = path
        self.root = root
        self.fd = _open_log(path, root)
        self.loss = loss if loss is not None else OutputLoss()
        self._lost = 0  # bytes lost since writing last worked
        self._error = ""
        self._at_line_start = True  # the last byte written was a newline (or none yet)

    def write(self, data: bytes) -> None:
        """Write everything; on an I/O error count the rest as lost and drop it."""
        if self._lost and not self._mark_loss():
            self._lose(len(data), None)
            return
        try:
            self._write_all(data)
        except _Unwritten as unwritten:
            self._lose(unwritten.left, unwritten.error)

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                written = os.write(self.fd, view)
            except OSError as exc:
                raise _Unwritten(len(view), exc) from None
            if written:
                self._at_line_start = view[written - 1] == 0x0A
            view = view[written:]

    def _lose(self, size: int, error: OSError | None) -> None:
        if error is not None:
            self.loss.write_errors += 1
            if not self._lost:
                self._error = error.strerror or str(error)
                logger.warning("cannot write %s: %s (counting the output lost until it works)",
                               self.path, self._error)
                self.loss.tell("output_write_failed", file=str(self.path), error=self._error)
        self.loss.lost_bytes += size
        self._lost += size

    def _mark_loss(self) -> bool:
        """Writing may work again: put the marker in first; False if it still fails."""
        marker = (b"" if self._at_line_start else b"\n") + (
            f"[elastic-supervisor: {self._lost} bytes of output lost here: "
            f"{self._error}]\n".encode()
        )
        try:
            self._write_all(marker)
        except _Unwritten:
            self.loss.write_errors += 1
            return False
        logger.warning("writing %s again: %d bytes of output were lost", self.path, self._lost)
        self.loss.tell("output_lost", file=str(self.path), bytes=self._lost, resumed=True)
        self._lost = 0
        return True

    async def reopen(self) -> None:
        """Continue in a fresh file at the same path; keep the old one if that fails. The
        open runs in a worker thread: the file system may block (a FIFO planted there is
        refused without blocking: ``safepaths``)."""
        try:
            fd = await anyio.to_thread.run_sync(_open_log, self.path, self.root)
        except OSError as exc:
            logger.warning("cannot reopen %s: %s; still writing the old file", self.path, exc)
            return
        if self.fd < 0:  # closed meanwhile: its output ended
            os.close(fd)
            return
        os.close(self.fd)
        self.fd = fd
        self._at_line_start = True

    def close(self) -> None:
        if self.fd >= 0:
            if self._lost and not self._mark_loss():
                logger.warning("%s closed with its last %d bytes of output lost (%s)",
                               self.path, self._lost, self._error)
                self.loss.tell("output_lost", file=str(self.path), bytes=self._lost,
                               resumed=False)
            os.close(self.fd)
            self.fd = -1


class _Unwritten(Exception):
    """``left`` bytes of a write could not be written (``error``)."""

    def __init__(self, left: int, error: OSError) -> None:
        super().__init__(left, error)
        self.left = left
        self.error = error


def _open_log(path: Path, root: Path | None) -> int:
    return open_below(root or path.parent, path)


class Console:
    """The supervisor's stdout or stderr, shared by every pump; writes whole blocks."""

    def __init__(self, fd: int, name: str) -> None:
        self.name = name
        self._writer = _ConsoleWriter.open(fd)
        self._busy = False  # a pump is finishing a partly written block
        self._idle = anyio.Event()
        self.broken = False

    @property
    def blocked(self) -> bool:
        """True while a pump waits for the console to take the rest of its block."""
        return self._busy

    async def write(self, block: bytes) -> None:
        """Write ``block`` whole before any other block; wait (not block) while full."""
        while self._busy:
            await self._idle.wait()
        view = memoryview(block)
        view = view[self._try(view) :]
        if not view:
            return
        self._busy = True
        try:
            while view:
                await anyio.wait_writable(self._writer.fd)
                view = view[self._try(view) :]
        finally:
            self._busy = False
            self._idle.set()
            self._idle = anyio.Event()

    def _try(self, data: memoryview) -> int:
        """Bytes written now (all of them if the console blocks); 0 if it is full."""
        if self.broken:
            return len(data)
        try:
            if not self._writer.can_wait:
                return _write_all(self._writer.send, data)
            return self._writer.send(data)
        except BlockingIOError:
            return 0
        except OSError as exc:  # EPIPE, EBADF: nobody reads our output any more
            self.broken = True
            logger.warning("console %s is gone (%s): worker output goes to log files only",
                           self.name, exc)
            return len(data)

    def close(self) -> None:
        self._writer.close()


def _write_all(send: Callable[[memoryview], int], data: memoryview) -> int:
    total = len(data)
    while data:
        data = data[send(data) :]
    return total


class _ConsoleWriter(msgspec.Struct, frozen=True):
    """A non-blocking way to write to a console fd that leaves the fd's flags alone.

    O_NONBLOCK belongs to the open file description, which workers and the shell share:
    setting it on fd 1 would make *their* writes fail with EAGAIN. So a pipe or terminal
    is opened again (a description of our own), a socket (journald) is sent to with
    MSG_DONTWAIT, and a regular file, which never reports "full", is written as it is.
    """

    fd: int  # what to wait on for writability
    send: Callable[[memoryview], int]
    can_wait: bool  # False: plain blocking writes (regular files, or nothing better)
    close: Callable[[], None]

    @classmethod
    def open(cls, fd: int) -> _ConsoleWriter:
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            mode = 0
        if stat.S_ISFIFO(mode) or stat.S_ISCHR(mode):
            flags = os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
            try:
                own = os.open(f"/proc/self/fd/{fd}", flags)
            except OSError as exc:
                logger.debug("cannot reopen fd %d (%s); console writes may block", fd, exc)
            else:
                return cls(own, partial(os.write, own), True, partial(os.close, own))
        if stat.S_ISSOCK(mode):
            sock = socket.socket(fileno=os.dup(fd))
            return cls(sock.fileno(), partial(_send_nowait, sock), True, sock.close)
        return cls(fd, partial(os.write, fd), False, lambda: None)


def _send_nowait(sock: socket.socket, data: memoryview) -> int:
    return sock.send(data, socket.MSG_DONTWAIT)


# ------------------------------------------------------------------ progress lines

MAX_SCANNED_LINE = 64 * 1024  # a longer line is matched on its first 64 KiB


class ProgressPatternError(OutputSpecError):
    """``--progress-pattern`` is not a regular expression; the message is one line."""


def compile_progress_pattern(text: str | None) -> re.Pattern[bytes] | None:
    """The ``--progress-pattern`` regex, matched against each output line's bytes."""
    if not text:
        return None
    try:
        return re.compile(text.encode())
    except re.error as exc:
        raise ProgressPatternError(f"progress_pattern: not a regular expression: {exc}") from None


class ProgressScan:
    """Finds the first line of a stream that matches the progress pattern."""

    def __init__(self, pattern: re.Pattern[bytes]) -> None:
        self.pattern = pattern
        self._partial = b""

    def feed(self, chunk: bytes) -> bool:
        """Whether a line completed by ``chunk`` matches."""
        *lines, rest = (self._partial + chunk).split(b"\n")
        self._partial = rest[:MAX_SCANNED_LINE]
        return any(self.pattern.search(line[:MAX_SCANNED_LINE]) for line in lines)


# ------------------------------------------------------------------ pumps


@dataclass(eq=False)
class Pump:
    """Copies one worker pipe: raw chunks to its file, whole prefixed lines to the console."""

    fd: int  # the pipe's read end, non-blocking
    dir_index: int
    label: str  # "attempt_K/LOCAL_RANK/stdout", for log messages
    file: LogFile
    console: Console | None = None
    prefix: bytes = b""
    filtered: LogFile | None = None
    needles: tuple[bytes, ...] = ()
    splitter: LineSplitter = field(default_factory=LineSplitter)
    # told once, at the first line matching --progress-pattern (the rank's progress)
    progress: ProgressScan | None = None
    on_progress_line: Callable[[], None] | None = None
    done: anyio.Event = field(default_factory=anyio.Event)
    # shielded: only EOF, request_stop() or cancel() end a pump, never the caller's scope,
    # so a supervisor shutting down still writes out what the workers said last
    scope: anyio.CancelScope = field(default_factory=lambda: anyio.CancelScope(shield=True))
    _waiting: anyio.CancelScope | None = None
    _stopping: bool = False
    _eof: bool = False
    moved: int = 0  # bytes read and shown so far: a drain waits on while this grows

    async def run(self) -> None:
        """Copy until EOF (or a stop request), then flush the last partial line."""
        with self.scope:
            try:
                while not self._eof and not self._stopping:
                    await self._wait_for_data()
                    await self._burst()
                if not self._eof:  # stopped: take what is in the pipe now, no more waiting
                    await self._burst()
                await self._emit(self.splitter.flush())
            finally:
                if not self._eof:
                    self._rest_to_file()
                os.close(self.fd)
                self.file.close()
                self.done.set()

    def request_stop(self) -> None:
        """Stop waiting for more output: copy what is there, flush, close."""
        self._stopping = True
        if self._waiting is not None:
            self._waiting.cancel()

    async def _wait_for_data(self) -> None:
        with anyio.CancelScope() as self._waiting:
            await anyio.sleep(COALESCE)  # let a chatty worker fill the pipe: fewer wakeups
            await anyio.wait_readable(self.fd)
        self._waiting = None

    async def _burst(self) -> None:
        """Read and copy what the pipe holds (bounded); sets ``_eof`` at EOF."""
        for _ in range(MAX_READS):
            try:
                chunk = os.read(self.fd, CHUNK)
            except BlockingIOError:
                return
            if not chunk:
                self._eof = True
                return
            self.moved += len(chunk)
            self.file.write(chunk)
            if self.progress is not None and self.progress.feed(chunk):
                self.progress = None  # the first match is all that is needed per attempt
                if self.on_progress_line is not None:
                    self.on_progress_line()
            if self.console is not None:
                await self._emit(self.splitter.feed(chunk))

    def _rest_to_file(self) -> None:
        """Given up on (stuck console): the file still gets what the pipe holds now."""
        with contextlib.suppress(OSError):
            for _ in range(MAX_READS):
                chunk = os.read(self.fd, CHUNK)
                if not chunk:
                    return
                self.file.write(chunk)

    async def _emit(self, pieces: list[Piece]) -> None:
        if not pieces or self.console is None:
            return
        if self.filtered is not None:
            matched = matching_lines(pieces, self.needles, self.prefix)
            if matched:
                self.filtered.write(matched)
        block = render(pieces, self.prefix)
        await self.console.write(block)
        self.moved += len(block)


# ------------------------------------------------------------------ the plan


class OutputPlan:
    """Decides each rank's stdout/stderr and runs the pumps of the pipes it hands out.

    Lifecycle: the composition root starts ``run`` with ``tg.start`` before any worker;
    the worker group calls ``open_rank`` -> spawn -> ``after_spawn`` for each worker and
    ``drain(dir_index)`` once an attempt's workers are dead (the controller too, before
    the exit barrier); SIGHUP calls ``reopen``.
    """

    def __init__(
        self,
        redirects: str,
        tee: str,
        local_world_size: int,
        *,
        local_ranks_filter: str = "",
        prefix_template: str | None = None,
        role: str = "default",
        hostname: str | None = None,
        stdout_filters: Sequence[str] = (),
        stderr_filters: Sequence[str] = (),
        console_fds: tuple[int, int] = (1, 2),
        progress_pattern: str | None = None,
    ) -> None:
        redirect_map = parse_std_map(redirects, local_world_size, what="redirects")
        tee_map = parse_std_map(tee, local_world_size, what="tee")
        shown = parse_ranks_filter(local_ranks_filter)
        self.routes: dict[int, dict[int, StreamRoute]] = {
            rank: {
                bit: route_stream(redirect_map[rank], tee_map[rank],
                                  shown is None or rank in shown, bit)
                for _, bit in STREAMS
            }
            for rank in range(local_world_size)
        }
        self.prefix_template = prefix_template
        self.role = role
        self.hostname = hostname if hostname is not None else socket.gethostname()
        self.needles = {
            OUT: tuple(f.encode() for f in stdout_filters if f),
            ERR: tuple(f.encode() for f in stderr_filters if f),
        }
        self.console_fds = {OUT: console_fds[0], ERR: console_fds[1]}
        self._consoles: dict[int, Console] = {}
        self._filtered: dict[tuple[int, int], LogFile] = {}
        self._pumps: list[Pump] = []
        self._child_fds: dict[int, list[int]] = {}
        self.loss = OutputLoss()  # what could not be written (metrics, events)
        self._tg: TaskGroup | None = None
        # a line matching it is progress (goodput, readiness): a bare first line is not,
        # since torch prints warnings while it imports and a warm standby prints at once
        self.progress_pattern = compile_progress_pattern(progress_pattern)
        # told the local rank of each pump's first line matching the pattern
        self.on_progress_line: Callable[[int], None] | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> OutputPlan:
        """The plan for ``elastic-supervisor run`` settings (raises OutputSpecError)."""
        return cls(
            settings.redirects, settings.tee, settings.local_world_size,
            local_ranks_filter=settings.local_ranks_filter,
            prefix_template=settings.log_line_prefix_template,
            role=settings.role,
            stdout_filters=settings.duplicate_stdout_filters,
            stderr_filters=settings.duplicate_stderr_filters,
            progress_pattern=settings.progress_pattern,
        )

    @property
    def uses_pipes(self) -> bool:
        """False when every stream inherits the console or /dev/null (nothing to pump)."""
        return any(r.to_file for per_rank in self.routes.values() for r in per_rank.values())

    @property
    def console_blocked(self) -> bool:
        """True while a full console holds a pump back (and so, soon, its worker)."""
        return any(console.blocked for console in self._consoles.values())

    # -------------------------------------------------------------- the pumps' task
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Host the pumps until cancelled; then write out what is left (bounded)."""
        async with anyio.create_task_group() as tg:
            for bit, fd in self.console_fds.items():
                if any(per_rank[bit].to_console for per_rank in self.routes.values()):
                    self._consoles[bit] = Console(fd, "stdout" if bit == OUT else "stderr")
            self._tg = tg
            task_status.started()
            try:
                await anyio.sleep_forever()
            finally:
                self._tg = None
                with anyio.CancelScope(shield=True):
                    await self._finish(list(self._pumps))
                for console in self._consoles.values():
                    console.close()

    # -------------------------------------------------------------- per worker
    def open_rank(
        self,
        dir_index: int,
        rank_dir: Path,
        local_rank: int,
        global_rank: int,
        *,
        restart_count: int = 0,
        root: Path | None = None,
    ) -> tuple[int | None, int | None]:
        """The worker's stdout and stderr fds (None: inherit ours); starts their pumps.
        ``root``: the log directory (see ``LogFile``).

        Raises OSError (e.g. the log file cannot be created) after closing what it opened.
        """
        fds: list[int | None] = []
        opened = self._child_fds.setdefault(local_rank, [])
        try:
            for name, bit in STREAMS:
                route = self.routes[local_rank][bit]
                if route.target is Target.INHERIT:
                    fds.append(None)
                    continue
                if route.target is Target.DEVNULL:
                    fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
                else:
                    prefix = render_prefix(
                        self.prefix_template, role_name=self.role, rank=global_rank,
                        local_rank=local_rank, hostname=self.hostname,
                        restart_count=restart_count,
                    )
                    fd = self._start_pump(dir_index, rank_dir, name, bit, route, prefix, root)
                    if self.progress_pattern is not None and self.on_progress_line is not None:
                        self._pumps[-1].progress = ProgressScan(self.progress_pattern)
                        self._pumps[-1].on_progress_line = partial(self.on_progress_line,
                                                                   local_rank)
                opened.append(fd)
                fds.append(fd)
        except BaseException:
            self.after_spawn(local_rank)  # a pump already started sees EOF and ends
            raise
        return fds[0], fds[1]

    def after_spawn(self, local_rank: int) -> None:
        """Close our copies of the worker's ends: the pipe reaches EOF when it exits."""
        for fd in self._child_fds.pop(local_rank, []):
            os.close(fd)

    def _start_pump(
        self, dir_index: int, rank_dir: Path, name: str, bit: int, route: StreamRoute,
        prefix: bytes, root: Path | None = None,
    ) -> int:
        """Make the pipe, open the log file, start the pump; returns the worker's end."""
        if self._tg is None:
            raise RuntimeError("OutputPlan.run() must be started before workers are spawned")
        console = self._consoles.get(bit) if route.to_console else None
        needles = self.needles[bit] if console is not None else ()
        # files first: if one cannot be opened, no pipe is left behind (and vice versa)
        log_file = LogFile(rank_dir / f"{name}.log", self.loss, root=root)
        try:
            filtered = (self._filtered_file(dir_index, rank_dir.parent, name, bit, root)
                        if needles else None)
            read_end, write_end = os.pipe2(os.O_CLOEXEC)
        except OSError:
            log_file.close()
            raise
        os.set_blocking(read_end, False)  # ours only: the worker's end stays blocking
        # over the per-user pipe quota the default 64 KiB pipe works too, with more wakeups
        with contextlib.suppress(OSError):
            fcntl.fcntl(write_end, _F_SETPIPE_SZ, PIPE_SIZE)
        pump = Pump(
            read_end, dir_index, f"{rank_dir.parent.name}/{rank_dir.name}/{name}", log_file,
            console, prefix, filtered, needles,
        )
        self._pumps.append(pump)
        self._tg.start_soon(pump.run, name=f"output {pump.label}")
        return write_end

    def _filtered_file(self, dir_index: int, attempt_dir: Path, name: str, bit: int,
                       root: Path | None = None) -> LogFile:
        """torchrun's ``attempt_K/filtered_{stdout,stderr}.log``, shared by the ranks."""
        key = (dir_index, bit)
        if key not in self._filtered:
            self._filtered[key] = LogFile(attempt_dir / f"filtered_{name}.log", self.loss,
                                          root=root)
        return self._filtered[key]

    # -------------------------------------------------------------- rotation, draining
    async def reopen(self) -> None:
        """Reopen every open log file at its path (after logrotate moved it)."""
        files = [p.file for p in self._pumps if not p.done.is_set()]
        for log_file in [*files, *self._filtered.values()]:
            await log_file.reopen()

    async def drain(self, dir_index: int, timeout: float = DRAIN_TIMEOUT) -> None:
        """Wait until the attempt's output is all written (EOF), at most ``timeout`` s."""
        await self._finish([p for p in self._pumps if p.dir_index == dir_index], timeout)
        for key in [k for k in self._filtered if k[0] == dir_index]:
            self._filtered.pop(key).close()

    async def _finish(self, pumps: list[Pump], timeout: float = DRAIN_TIMEOUT) -> None:
        """EOF within ``timeout`` of the last byte moved (a slow console is no reason to
        cut the workers' last lines; at most DRAIN_MAX in all), else stop reading; give up
        on a stuck console last."""
        if not await _drained(pumps, timeout):
            stuck = [p.label for p in pumps if not p.done.is_set()]
            logger.warning("output still open %.1f s after the workers ended (a descendant "
                           "holds it?): closing %s", timeout, ", ".join(stuck))
            for pump in pumps:
                pump.request_stop()
            if not await _all_done(pumps, STOP_TIMEOUT):
                logger.warning("console does not take output: dropping the rest")
                for pump in pumps:
                    pump.scope.cancel()
                await _all_done(pumps, STOP_TIMEOUT)
        self._pumps = [p for p in self._pumps if p not in pumps]


async def _drained(pumps: Sequence[Pump], idle: float) -> bool:
    """Whether every pump reached EOF, waiting while any of them still moves bytes: until
    none has moved any for ``idle`` s (a descendant holds the pipe open, or the console
    takes nothing), at most DRAIN_MAX s."""
    deadline = anyio.current_time() + DRAIN_MAX
    while True:
        moved = sum(p.moved for p in pumps)
        if await _all_done(pumps, min(idle, max(deadline - anyio.current_time(), 0))):
            return True
        if sum(p.moved for p in pumps) == moved or anyio.current_time() >= deadline:
            return False


async def _all_done(pumps: Sequence[Pump], timeout: float) -> bool:
    with anyio.move_on_after(timeout):
        for pump in pumps:
            await pump.done.wait()
        return True
    return False
