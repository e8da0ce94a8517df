"""``--preload auto``: what a rank's next standby imports, learned from its last worker.

The rule (docs/design.md, "standby"):

- A warm worker (one that runs in a standby) records the modules it has imported, 1, 5,
  20 and 60 s after it started, in ``attempt_K/LOCAL_RANK/imported_modules.txt`` (one
  name per line, in import order), leaving out every module whose file lies under the
  script's directory or the working directory. A worker killed by SIGKILL has written its
  last record by then; nothing is recorded at exit.
- A cold worker records nothing; for it the supervisor reads ``/proc/PID/maps`` once the
  rank has progressed and takes the top-level packages of the shared objects it mapped
  from a ``site-packages``/``dist-packages`` directory (``torch`` for a torch job), each
  followed by the modules that package is known to import lazily, at their first use
  (``LAZY_IMPORTS``: ``torch._dynamo`` after ``torch``), which no map can show.
- The next standby of that rank imports those of the names whose top-level package
  belongs to an installed distribution (``importlib.metadata``), at idle priority, while
  every read of a per-attempt variable (``RANK``, ``MASTER_PORT``...) through
  ``os.environ`` is watched: a module that reads one while it imports taints the standby,
  which is discarded; its top-level package is never preloaded again in this run, and a
  new standby starts without it. Reads from C (``getenv``) are not seen.

The node's list is also kept in the run directory (``LOG_DIR/RUN_ID/preload-auto.json``),
so that the next run with the same log directory and run id (a systemd restart, a job run
again) starts its fork server with it at once instead of learning it again.

This module holds the supervisor's side: reading what workers left and what an earlier run
kept (untrusted input: bounded, validated, never followed through a symlink) and writing a
standby's list and the node's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import marshal
import os
import stat
import tempfile
from pathlib import Path

from supervisor.core.envs import PER_ATTEMPT_ENV
from supervisor.safepaths import replace_file

logger = logging.getLogger(__name__)

RECORD_NAME = "imported_modules.txt"
KEPT_NAME = "preload-auto.json"  # the node's list, kept in the run directory
MAX_RECORD = 4 << 20  # bytes of a worker's record we read at most
MAX_NAMES = 20_000
_SITE_DIRS = ("site-packages", "dist-packages")
# What a package imports lazily, at its first use, that a cold worker's maps cannot show
# (pure Python). DDP's constructor, FSDP and torch.compile import torch._dynamo: 1.0-1.4 s
# of a warm restart without it (docs/benchmarks.md). A torch job that never uses them
# pays that import once per node, in the fork server at idle priority, and its memory.
LAZY_IMPORTS: dict[str, tuple[str, ...]] = {"torch": ("torch._dynamo",)}


def is_module_name(name: str) -> bool:
    return bool(name) and len(name) < 256 and all(p.isidentifier() for p in name.split("."))


def read_record(rank_dir: Path) -> list[str]:
    """The module names a warm worker recorded (empty if none or unreadable)."""
    data = _read_bounded(rank_dir / RECORD_NAME)
    names = [n for n in data.decode("utf-8", "replace").splitlines() if is_module_name(n)]
    return names[:MAX_NAMES]


def read_kept(run_dir: Path) -> tuple[list[str], set[str]]:
    """What an earlier run with this run directory learned: the node's names and the
    packages excluded as tainted (both empty if absent, unreadable or malformed)."""
    try:
        doc = json.loads(_read_bounded(run_dir / KEPT_NAME) or b"{}")
    except (ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict):
        logger.warning("%s is malformed: --preload auto learns again", run_dir / KEPT_NAME)
        return [], set()
    names, excluded = doc.get("names", []), doc.get("exclude", [])
    if not isinstance(names, list) or not isinstance(excluded, list):
        return [], set()
    return _module_names(names), set(_module_names(excluded))


def _module_names(values: list[object]) -> list[str]:
    """The valid module names among ``values``, once each, in order, at most MAX_NAMES."""
    valid = (v for v in values if isinstance(v, str) and is_module_name(v))
    return list(dict.fromkeys(valid))[:MAX_NAMES]


def keep(run_dir: Path, names: list[str], excluded: set[str]) -> None:
    """Keep the node's list for the next run (written whole, then renamed: a reader never
    sees half of it; nothing a worker planted there is opened: ``safepaths.replace_file``).
    A failure (a full disk) is one warning: the next run learns again."""
    data = json.dumps({"names": names, "exclude": sorted(excluded)}).encode()
    try:
        replace_file(run_dir / KEPT_NAME, data)
    except OSError as exc:
        logger.warning("cannot keep --preload auto's list in %s: %s", run_dir, exc)


def _read_bounded(path: Path) -> bytes:
    """A regular file's bytes, at most ``MAX_RECORD`` (empty if absent, not a regular file,
    a symlink, unreadable or larger)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return b""
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b""
        try:
            data = f.read(MAX_RECORD + 1)
        except OSError:
            return b""
    return b"" if len(data) > MAX_RECORD else data


def cold_worker_modules(pid: int) -> list[str]:
    """What a cold worker shows that it uses: the packages of the shared objects it mapped,
    each followed by what that package imports lazily (``LAZY_IMPORTS``)."""
    return with_lazy_imports(mapped_packages(pid))


def with_lazy_imports(packages: list[str]) -> list[str]:
    return [name for top in packages for name in (top, *LAZY_IMPORTS.get(top, ()))]


def mapped_packages(pid: int) -> list[str]:
    """Top-level packages of the shared objects ``pid`` mapped from site-packages."""
    found: dict[str, None] = {}
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.rstrip("\n").partition("/")[2]
                if not path.endswith(".so") and ".so." not in path:
                    continue
                parts = ("/" + path).split("/")
                for i, part in enumerate(parts[:-2]):
                    if part in _SITE_DIRS:
                        top = parts[i + 1]
                        if is_module_name(top) and not top.endswith(".libs"):
                            found[top] = None
                        break
    except OSError:
        return []
    return list(found)


def write_spec(names: list[str], exclude: set[str]) -> str:
    """A private file with the standby's auto list (it reads and removes it)."""
    fd, path = tempfile.mkstemp(prefix="elastic-supervisor-preload-")
    with os.fdopen(fd, "wb") as f:
        f.write(marshal.dumps({
            "names": names, "exclude": sorted(exclude), "watch": list(PER_ATTEMPT_ENV),
        }))
    return path


def remove_spec(path: str | None) -> None:
    if path:
        with contextlib.suppress(OSError):
            os.unlink(path)
