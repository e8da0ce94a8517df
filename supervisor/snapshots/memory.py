"""The regions of shared memory that hold snapshots: files in a private tmpfs directory.

The supervisor creates every region (mode 0600, in a 0700 directory of its own under
``--snapshot-memory-dir``, /dev/shm by default) and reserves its pages when it creates
it (``posix_fallocate``): a full tmpfs is a clean refusal here, never a SIGBUS in the
worker that maps it. A region that must grow is replaced by a new file (a new name), so
a worker never maps a file that shrank under it. The directory goes when the job ends; one
left by a supervisor that was killed (no cleanup runs then) is removed by the next
supervisor that starts on the node, once its owner's pid is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import stat
from pathlib import Path

from supervisor.core.slots import Slot
from supervisor.pids import pid_exists

logger = logging.getLogger(__name__)

PREFIX = "elastic-supervisor-snapshots-"


class Regions:
    """This supervisor's directory of regions."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @classmethod
    def create(cls, base: Path) -> Regions:
        """A fresh private directory under ``base`` (after sweeping dead supervisors')."""
        sweep_stale(base)
        directory = base / f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        os.mkdir(directory, 0o700)
        os.chmod(directory, 0o700)  # mkdir's mode passes through the umask
        return cls(directory)

    def path(self, slot: Slot) -> Path:
        return self.directory / slot.name

    def make(self, slot: Slot, old: Slot | None) -> None:
        """Create ``slot``'s region with every page reserved; remove ``old``'s file (the
        region it replaces). Raises ``OSError`` (ENOSPC: the tmpfs is full)."""
        self.reserve(slot.name, slot.capacity)
        if old is not None and old.capacity:
            self.drop(old)

    def reserve(self, name: str, capacity: int) -> Path:
        """Create the region ``name`` of ``capacity`` bytes, every page reserved. Raises
        ``OSError`` (ENOSPC: the tmpfs is full; EEXIST: the name is taken)."""
        path = self.directory / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o600)
        try:
            os.posix_fallocate(fd, 0, capacity)
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return path

    def drop(self, slot: Slot) -> None:
        """Free a region (a worker's mapping keeps its pages until it unmaps)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(slot))

    def open_read(self, slot: Slot) -> int:
        """A read-only descriptor of ``slot``'s region (persistence)."""
        return os.open(self.path(slot), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def sweep_stale(base: Path) -> None:
    """Remove region directories of our user whose supervisor is gone (killed by SIGKILL:
    nothing of it could clean up). The pid is in the name; a live one is left alone."""
    try:
        entries = list(os.scandir(base))
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith(PREFIX):
            continue
        pid_text = entry.name[len(PREFIX):].split("-", 1)[0]
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid()
                or not pid_text.isdigit() or pid_exists(int(pid_text))):
            continue
        logger.info("removing %s: left by supervisor pid %s, which is gone", entry.path,
                    pid_text)
        shutil.rmtree(entry.path, ignore_errors=True)


