"""The guardian: a tiny helper process that kills worker process groups if we die.

Workers get the kernel's parent-death signal, but their own children do not. The guardian
holds the read end of a pipe from the supervisor and a list of worker process groups; when
the pipe reaches EOF (the supervisor exited, even by SIGKILL) it SIGKILLs every group still
registered. It runs in its own session and ignores SIGINT/SIGTERM so a Ctrl-C in a terminal
does not take it down before the supervisor has stopped the workers itself.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
import sys

logger = logging.getLogger(__name__)

COOKIE_ENV = "ELASTIC_SUPERVISOR_COOKIE"
"""In every worker's environment, so inherited by descendants that leave the worker's
session (setsid), which the guardian then finds in ``/proc/PID/environ``."""

# The guardian needs only builtins: a POSIX shell costs ~1.6 MB of memory against ~9 MB for
# a Python interpreter. Groups are kept as " 12 34 " and removed by pattern, never by pid
# arithmetic; on EOF every group still registered gets SIGKILL.
_GUARDIAN_SH = r"""
trap '' INT TERM HUP
groups=' '
while read -r op pgid; do
  case "$pgid" in ''|*[!0-9]*) continue ;; esac
  case "$op" in
    +) groups="$groups$pgid " ;;
    -) case "$groups" in *" $pgid "*) groups="${groups%% $pgid *} ${groups#* $pgid }" ;; esac ;;
  esac
done
for pgid in $groups; do kill -9 -"$pgid" 2>/dev/null; done
# descendants that left the groups (setsid) still carry the cookie in their environment;
# a few passes, since one may have been forking while the last pass ran
[ -n "$1" ] && for pass in 1 2 3 4 5 6 7 8; do
  found=$(grep -lsxzF -- "$1" /proc/[0-9]*/environ)  # status 2: some were unreadable
  [ -n "$found" ] || break
  for f in $found; do p=${f#/proc/}; kill -9 "${p%/environ}" 2>/dev/null; done
done
"""

_GUARDIAN_PY = r"""
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
groups = set()
for line in sys.stdin.buffer:
    op, _, pgid = line.strip().partition(b" ")
    if op == b"+":
        groups.add(int(pgid))
    elif op == b"-":
        groups.discard(int(pgid))
for pgid in groups:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
cookie = sys.argv[1].encode() if len(sys.argv) > 1 else b""
for _ in range(8 if cookie else 0):
    found = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fd = os.pidfd_open(int(entry))  # pinned: a recycled pid is never the one hit
        except OSError:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if cookie in f.read().split(b"\0"):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                    found += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    if not found:
        break
"""


class Guardian:
    """Keeps the guardian process informed of live worker process groups."""

    def __init__(self, cookie: str | None = None) -> None:
        """``cookie``: the value of ``COOKIE_ENV`` in every worker's environment. When the
        supervisor dies, every process still carrying it is killed too."""
        shell = shutil.which("sh")
        mark = [f"{COOKIE_ENV}={cookie}"] if cookie else []
        argv = ([shell, "-c", _GUARDIAN_SH, "guardian", *mark] if shell
                else [sys.executable, "-S", "-c", _GUARDIAN_PY, *mark])
        self._proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _send(self, line: str) -> None:
        stdin = self._proc.stdin
        if stdin is None:
            return
        try:
            stdin.write(line.encode())
            stdin.flush()
        except (BrokenPipeError, ValueError):
            logger.warning("guardian process is gone; orphan protection relies on pdeathsig")

    def watch(self, pgid: int) -> None:
        self._send(f"+ {pgid}\n")

    def forget(self, pgid: int) -> None:
        self._send(f"- {pgid}\n")

    def close(self) -> None:
        """Normal shutdown: every group was stopped already, so the guardian kills nothing."""
        if self._proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self._proc.stdin.close()
        self._proc.wait()


def set_child_subreaper() -> bool:
    """Become a child subreaper so a worker's orphaned descendants are reparented to us."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(36, 1, 0, 0, 0) == 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False

