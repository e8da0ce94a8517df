"""Which supervisors run on this host, for ``elastic-supervisor status`` without ``--url``.

Each supervisor writes ``health.json`` (its pid, health URL and run id) into its runtime
directory once its health port is bound: a private 0700 temp dir
(``$TMPDIR/elastic-supervisor-run-*``) or systemd's ``/run/elastic-supervisor[/INSTANCE]``.
``status`` reads those whose process is alive, in directories and files owned by the user
running it and writable by no one else. The default port alone is a guess: a
supervisor whose default port was busy moved to another one, and the one holding the
default may be another job.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from supervisor.pids import pid_exists

ANNOUNCE = "health.json"
RUN_PREFIX = "elastic-supervisor-run-"
SYSTEMD_ROOT = Path("/run/elastic-supervisor")
MAX_ANNOUNCE = 4096


@dataclass(frozen=True)
class Found:
    """One supervisor on this host."""

    pid: int
    url: str
    run_id: str
    where: str  # its runtime directory


def local_url(host: str, port: int) -> str:
    """The URL a process on this host reaches a health port bound to ``host`` at."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def announce(runtime_dir: Path, url: str, run_id: str) -> None:
    """Write ``health.json`` (0600, whole or not at all) into ``runtime_dir``. Best effort:
    a supervisor that cannot write it still runs (``status --url`` finds it)."""
    body = json.dumps({"pid": os.getpid(), "url": url, "run_id": run_id}).encode()
    tmp = runtime_dir / f".{ANNOUNCE}.{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(body)
        os.replace(tmp, runtime_dir / ANNOUNCE)
    except OSError:
        tmp.unlink(missing_ok=True)


def find_supervisors(roots: Iterable[Path] | None = None) -> list[Found]:
    """The live supervisors that announced themselves in a runtime directory of this user,
    by pid."""
    dirs = _runtime_dirs() if roots is None else list(roots)
    found = [f for f in (_read(d) for d in dirs) if f is not None and pid_exists(f.pid)]
    return sorted(found, key=lambda f: f.pid)


def _runtime_dirs() -> list[Path]:
    tmp = Path(tempfile.gettempdir())
    dirs = sorted(tmp.glob(f"{RUN_PREFIX}*"))
    dirs += [SYSTEMD_ROOT, *sorted(SYSTEMD_ROOT.glob("*"))]
    return dirs


def _ours(st: os.stat_result) -> bool:
    """Owned by the user running this (root's own, for root), and writable by no one else:
    a directory another user planted in the shared temp dir is never read."""
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _read(directory: Path) -> Found | None:
    """The announcement in ``directory``, or None if absent, odd, unreadable, or not in a
    directory of this user's (any process of the supervisor's user may write there: what
    it says is checked too)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        dir_fd = os.open(directory, flags | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        if not _ours(os.fstat(dir_fd)):
            return None
        data = _load(os.open(ANNOUNCE, flags, dir_fd=dir_fd))
    except OSError:
        return None
    finally:
        os.close(dir_fd)
    if not isinstance(data, dict):
        return None
    pid, url, run_id = data.get("pid"), data.get("url"), data.get("run_id")
    if not (isinstance(pid, int) and pid > 0 and isinstance(url, str) and _http(url)):
        return None
    return Found(pid, url, str(run_id) if isinstance(run_id, str) else "?", str(directory))


def _load(fd: int) -> object:
    """The JSON of a regular file of ours at ``fd`` (closed), or None."""
    try:
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) and _ours(st)):
            return None
        return json.loads(os.read(fd, MAX_ANNOUNCE + 1)[:MAX_ANNOUNCE])
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)


def _http(url: str) -> bool:
    """``http://HOST:PORT`` and nothing else (no path, query, user or control character)."""
    try:
        parts = urlsplit(url)
        return (parts.scheme == "http" and bool(parts.hostname) and parts.port is not None
                and not (parts.path or parts.query or parts.fragment or parts.username)
                and url.isprintable() and len(url) <= 300)
    except ValueError:
        return False


