"""The guardian: a tiny helper process that kills worker process groups if we die.

Workers get the kernel's parent-death signal, but their own children do not. The guardian
holds the read end of a pipe from the supervisor and a list of worker process groups; when
the pipe reaches EOF (the supervisor exited, even by SIGKILL) it SIGKILLs every group still
registered, then every process of our uid that still carries the supervisor's cookie, and
removes the supervisor's private runtime directory. It runs in its own session and ignores
SIGINT/SIGTERM/SIGHUP so a Ctrl-C in a terminal does not take it down before the supervisor
has stopped the workers itself.

It can run as root, so it is careful whom it kills:

- Registrations are pinned: ``+ PGID START`` names the group leader's start time, and the
  guardian keeps a pidfd on the leader only if the process it opened has that start time.
  A group is killed by number only while that pidfd shows its leader still exists (alive or
  a zombie), so the group id cannot have been recycled.
- Every pid the supervisor reaps is forgotten first (``spawn.on_reaping``), wherever the
  reaping happens (a stop, a later sweep of an adopted child, a standby's discard).
- Everything else (members of a group whose leader is gone, cookie carriers) is found in
  ``/proc``, pinned with a pidfd, and killed only if its real uid is ours.
- The cookie never appears on a command line: it reaches the guardian in its environment
  (``/proc/PID/environ`` is readable only by the same uid and root).

Writes to the pipe never block the event loop: the write end is non-blocking; when the
guardian stops reading (SIGSTOPped, or starved) and the pipe is full, messages wait in a
per-group backlog (a later message for the same group replaces or cancels an earlier one,
so it is bounded by the number of groups) and are delivered as soon as the pipe drains.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import anyio
from anyio.abc import TaskStatus

from supervisor.workers.spawn import on_reaping

logger = logging.getLogger(__name__)

COOKIE_ENV = "ELASTIC_SUPERVISOR_COOKIE"
"""In every worker's environment, so inherited by descendants that leave the worker's
session (setsid), which the guardian then finds in ``/proc/PID/environ``."""

_MARK_ENV = "ELASTIC_SUPERVISOR_GUARDIAN_MARK"  # "COOKIE_ENV=cookie", the entry to look for
_RUNDIR_ENV = "ELASTIC_SUPERVISOR_GUARDIAN_RUNDIR"  # the runtime directory to remove

CLOSE_WAIT = 5.0  # seconds a normal close waits for the guardian's final sweep

# A Python guardian (not a shell loop) because only it can hold pidfds: every kill is
# pinned. Measured (benchmarks in docs/security.md): 9.6 MB RSS but 3.6 MB USS (libpython's
# pages are shared with the supervisor), ~11 ms CPU once at start; the shell loop it
# replaces cost 1.7 MB RSS / 0.2 MB USS. Builtin modules only until the very end.
_GUARDIAN_PY = r"""
import os, signal, sys

def stat_fields(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()  # [state, ppid, pgrp, ...]

def real_uid(pid):
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith(b"Uid:"):
                return int(line.split()[1])
    return -1

def pin(pgid, start):
    try:
        fd = os.pidfd_open(pgid)
    except OSError:
        return None
    try:  # read after the open: a pid recycled meanwhile shows another start time
        fields = stat_fields(pgid)
        if int(fields[19]) == start and int(fields[2]) == pgid:
            return fd
    except (OSError, ValueError, IndexError):
        pass
    os.close(fd)
    return None

def kill_groups(groups):
    killed = []
    for pgid, fd in groups.items():
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except OSError:
            continue  # leader reaped: its group's members are left to the sweep's checks
        try:  # the leader (alive or a zombie) still holds the id: the group is ours
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
        killed.append(pgid)
    return killed

def ours(pid, groups, mark, uid):
    fields = stat_fields(pid)
    if fields[0] == b"Z" or real_uid(pid) != uid:
        return False
    if int(fields[2]) in groups:
        return True
    if not mark:
        return False
    with open(f"/proc/{pid}/environ", "rb") as f:
        return mark in f.read().split(b"\0")

def sweep(groups, mark, uid):
    me, hit = os.getpid(), 0
    for _ in range(8):  # a few passes: one may have been forking while the last ran
        found = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == me:
                continue
            try:
                fd = os.pidfd_open(int(entry))  # pinned: a recycled pid is never the one hit
            except OSError:
                continue
            try:
                if ours(int(entry), groups, mark, uid):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                    found += 1
            except (OSError, ValueError, IndexError):
                pass
            finally:
                os.close(fd)
        hit += found
        if not found:
            break
    return hit

def remove(path, uid):
    try:
        st = os.lstat(path)
    except OSError:
        return
    if st.st_uid == uid and (st.st_mode & 0o170000) == 0o040000:  # our directory, no link
        import shutil
        shutil.rmtree(path, ignore_errors=True)  # fd-based: never follows a planted link

def main():
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    mark = os.environ.get("ELASTIC_SUPERVISOR_GUARDIAN_MARK", "").encode()
    rundir = os.environ.get("ELASTIC_SUPERVISOR_GUARDIAN_RUNDIR", "")
    uid = os.getuid()
    groups = {}
    for line in sys.stdin.buffer:
        op, _, rest = line.strip().partition(b" ")
        pgid, _, start = rest.partition(b" ")
        if not pgid.isdigit():
            continue
        old = groups.pop(int(pgid), None)
        if old is not None:
            os.close(old)
        if op == b"+" and start.isdigit():
            fd = pin(int(pgid), int(start))
            if fd is not None:
                groups[int(pgid)] = fd
    killed = kill_groups(groups)
    swept = sweep(set(groups), mark, uid)
    for path in rundir.split("\n"):
        if path:
            remove(path, uid)
    if killed or swept:
        os.write(2, b"elastic-supervisor guardian: supervisor gone; SIGKILLed process groups %s"
                    b" and %d process(es) of ours\n" % (str(killed).encode(), swept))

main()
"""


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), which pins it against reuse."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


class Guardian:
    """Keeps the guardian process informed of live worker process groups."""

    def __init__(
        self,
        cookie: str | None = None,
        *,
        runtime_dir: str | Path | None = None,
        also_remove: Sequence[str | Path] = (),
        environ: Mapping[str, str] | None = None,
    ) -> None:
        """``cookie``: the value of ``COOKIE_ENV`` in every worker's environment. When the
        supervisor dies, every process of our uid still carrying it is killed too.
        ``runtime_dir``: a directory of ours the guardian removes when the pipe closes
        (the supervisor's private runtime directory, which a SIGKILL would leave behind);
        ``also_remove``: more such directories (the snapshot regions: memory, not disk).
        ``environ``: the guardian's environment (default ours), to which the cookie and
        the directory are added: never the command line, which every user can read."""
        env = dict(os.environ if environ is None else environ)
        if cookie:
            env[_MARK_ENV] = f"{COOKIE_ENV}={cookie}"
        removed = [str(p) for p in ([runtime_dir] if runtime_dir is not None else [])]
        removed += [str(p) for p in also_remove]
        if removed:
            env[_RUNDIR_ENV] = "\n".join(removed)  # directories we made: no newline in them
        read_end, self._fd = os.pipe2(os.O_CLOEXEC)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _GUARDIAN_PY],
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                close_fds=True,
            )
        except BaseException:
            os.close(self._fd)
            raise
        finally:
            os.close(read_end)
        os.set_blocking(self._fd, False)  # a stopped guardian must never block the loop
        self._watched: set[int] = set()  # groups the guardian should hold (our mirror)
        self._backlog: dict[int, bytes] = {}  # per group: the message not yet in the pipe
        self._backlogged: anyio.Event | None = None  # set by _queue for run()
        self._gone = False
        self.queued_total = 0
        """Messages that had to wait because the pipe was full (for metrics)."""
        self._unsubscribe = on_reaping(self.forget)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def watched(self) -> frozenset[int]:
        """The process groups the guardian holds (or will, once it reads its pipe)."""
        return frozenset(self._watched)

    @property
    def backlog(self) -> int:
        """Messages waiting for the guardian to read its pipe."""
        return len(self._backlog)

    def watch(self, pgid: int) -> None:
        """Register a worker's process group (its leader must be our unreaped child)."""
        start = start_time(pgid)
        if start is None:
            logger.warning("cannot register process group %d with the guardian: gone", pgid)
            return
        self._watched.add(pgid)
        self._send(pgid, b"+ %d %d\n" % (pgid, start))

    def forget(self, pgid: int) -> None:
        """Unregister a group; must happen before its leader is reaped (``on_reaping``)."""
        if pgid not in self._watched:
            return
        self._watched.discard(pgid)
        if self._backlog.pop(pgid, b"").startswith(b"+"):
            return  # the guardian never heard of it
        self._send(pgid, b"- %d\n" % pgid)

    def _send(self, pgid: int, line: bytes) -> None:
        if self._gone:
            return
        self._flush()
        if self._backlog or not self._write(line):
            self._queue(pgid, line)

    def _write(self, line: bytes) -> bool:
        """One line (< PIPE_BUF, so written whole or not at all); False if the pipe is full."""
        if self._gone:
            return True  # nothing to tell any more
        try:
            os.write(self._fd, line)
        except BlockingIOError:
            return False
        except OSError:  # EPIPE: the guardian was killed
            self._gone = True
            self._backlog.clear()
            logger.warning("guardian process is gone; orphan protection relies on pdeathsig")
        return True

    def _queue(self, pgid: int, line: bytes) -> None:
        if not self._backlog:
            logger.warning("guardian (pid %d) is not reading its pipe (stopped?): "
                           "queueing its messages", self.pid)
            if self._backlogged is not None:
                self._backlogged.set()
        self._backlog[pgid] = line
        self.queued_total += 1

    def _flush(self) -> None:
        """Deliver what waits, oldest first, until the pipe is full again."""
        if not self._backlog:
            return
        for pgid, line in list(self._backlog.items()):
            if not self._write(line):
                return
            self._backlog.pop(pgid, None)
        logger.warning("guardian (pid %d) reads again: queued messages delivered "
                       "(%d had to wait so far)", self.pid, self.queued_total)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Deliver queued messages as soon as the pipe drains (a task of the app)."""
        self._backlogged = anyio.Event()
        task_status.started()
        while True:
            if not self._backlog:
                await self._backlogged.wait()
                self._backlogged = anyio.Event()
            while self._backlog and not self._gone:
                await anyio.wait_writable(self._fd)
                self._flush()

    def close(self) -> None:
        """Normal shutdown: every group was stopped already, so the guardian kills nothing.

        Waits (bounded) for its final sweep; a guardian that does not read is left to
        finish by itself when it is continued."""
        self._unsubscribe()
        if self._fd < 0:
            return
        self._flush()
        if self._backlog:
            logger.error("guardian (pid %d) did not read %d message(s) before shutdown",
                         self.pid, len(self._backlog))
        os.close(self._fd)
        self._fd = -1
        self._gone = True
        try:
            self._proc.wait(CLOSE_WAIT)
        except subprocess.TimeoutExpired:
            logger.error("guardian (pid %d) did not finish within %.0f s (stopped?)",
                         self.pid, CLOSE_WAIT)


def set_child_subreaper() -> bool:
    """Become a child subreaper so a worker's orphaned descendants are reparented to us."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(36, 1, 0, 0, 0) == 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False
