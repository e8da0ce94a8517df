"""``--snapshot-dir``: complete steps written from shared memory to files, and read back
by a run that starts with nothing in memory.

Blocking file I/O: called in a worker thread, never on the event loop. A step is written
file by file, each streamed from its region with ``copy_file_range`` (no copy through
our memory), ``fsync``-ed and renamed into place; then the node's part (``part.json``)
the same way; then, when every node's part is there, the job-wide marker; then steps
older than the two newest complete ones are removed. The layout and what is
trusted in it: ``core.snapshotdir``.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from supervisor.core.slots import Slot
from supervisor.core.snapshotdir import (
    MANIFEST,
    MARKER,
    Manifest,
    Marker,
    Part,
    file_name,
    merge,
    node_of,
    parse_manifest,
    parse_marker,
    parse_part,
    part_name,
    step_dir,
    step_of,
    to_prune,
)
from supervisor.snapshots import zipformat

OpenRegion = Callable[[Slot], int]  # a read-only descriptor of a slot's region


class DirRefused(Exception):
    """DIR cannot be used (not ours, another run's, malformed): one line says why."""


@dataclass(frozen=True)
class OnDisk:
    """A complete step found in DIR: its marker and where its files are."""

    marker: Marker
    directory: Path

    def path(self, key: int) -> Path:
        return self.directory / self.marker.files[key]


class SnapshotDir:
    """The job's ``--snapshot-dir`` as this node sees it."""

    def __init__(self, path: Path, run_id: str, *, any_run: bool = False) -> None:
        self.path = path
        self.run_id = run_id
        self.any_run = any_run

    def check(self) -> None:
        """Made if missing (0700); must be a directory of this user's. ``DirRefused``."""
        with contextlib.suppress(FileExistsError):
            self.path.mkdir(mode=0o700, parents=True)
        st = os.stat(self.path)
        if not stat.S_ISDIR(st.st_mode):
            raise DirRefused(f"{self.path} is not a directory")
        if st.st_uid != os.geteuid():
            raise DirRefused(f"{self.path} is owned by uid {st.st_uid}, not by this user "
                             f"({os.geteuid()})")

    def manifest(self) -> Manifest | None:
        """DIR's manifest if it has one and this run may use it; ``DirRefused`` if not."""
        try:
            data = _read_small(self.path / MANIFEST)
        except FileNotFoundError:
            return None
        found = parse_manifest(data)
        if isinstance(found, str):
            raise DirRefused(f"{self.path / MANIFEST}: {found}")
        if found.run_id != self.run_id and not self.any_run:
            raise DirRefused(f"{self.path} holds run {found.run_id!r}, not {self.run_id!r} "
                             "(--snapshot-resume-any uses it anyway)")
        return found

    # ------------------------------------------------------------------ reading
    def newest(self) -> OnDisk | None:
        """The newest step whose marker is valid; ``DirRefused`` for a bad manifest. A
        malformed marker is skipped (the older complete step is used)."""
        found = self.complete()
        return found[0] if found else None

    def complete(self) -> list[OnDisk]:
        """Every step whose marker is valid, the newest first; ``DirRefused`` for a bad
        manifest."""
        self.manifest()
        found = []
        for step in sorted(self._steps(), reverse=True):
            directory = self.path / step_dir(step)
            try:
                marker = parse_marker(_read_small(directory / MARKER), step)
            except OSError:
                continue
            if not isinstance(marker, str):
                found.append(OnDisk(marker, directory))
        return found

    def at(self, step: int) -> OnDisk | None:
        """``step`` if it is complete in DIR."""
        return next((d for d in self.complete() if d.marker.step == step), None)

    def _steps(self) -> list[int]:
        try:
            names = os.listdir(self.path)
        except OSError:
            return []
        return [s for s in (step_of(n) for n in names) if s is not None]

    # ------------------------------------------------------------------ writing
    def write(self, step: int, slots: dict[int, Slot], open_region: OpenRegion,
              world_size: int, replicated: bool, *, group_rank: int = 0,
              nodes: int = 1) -> bool:
        """Write this node's part of ``step`` (its ``slots``, then its ``part.json``), then
        the job-wide marker if every node's part is there; prune old steps. Returns
        whether the step is complete in DIR. Raises ``OSError`` (a full or unwritable DIR)
        with DIR left consistent."""
        self.manifest()  # raises DirRefused for another run's DIR
        tag = f"node{group_rank}"  # temporary names of its own: DIR may be shared
        _atomic_write(self.path / MANIFEST, Manifest(self.run_id, world_size).encode(), tag)
        directory = self.path / step_dir(step)
        files: dict[int, str] = {}
        for key, slot in sorted(slots.items()):
            name = file_name(group_rank, key)
            target = directory / name
            target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = open_region(slot)
            try:
                _check_region(fd, slot)
                _stream_into(target, fd, slot.size)
            finally:
                os.close(fd)
            files[key] = name
        part = Part(step, group_rank, 1 if replicated else nodes, world_size, replicated, files)
        _atomic_write(directory / part_name(group_rank), part.encode(), tag)
        _fsync_dir(directory / f"node{group_rank}")
        for other in self._steps():  # a part another node wrote at the same moment
            if other != step:
                self._complete_step(other, tag)
        done = self._complete_step(step, tag)
        self._prune()
        return done

    def _complete_step(self, step: int, tag: str) -> bool:
        """Write ``step``'s job-wide marker if every node's part is there (the same bytes
        whichever node writes it); whether the step is complete."""
        directory = self.path / step_dir(step)
        if (directory / MARKER).exists():
            return True
        parts = []
        try:
            names = os.listdir(directory)
        except OSError:
            return False
        for name in names:
            group_rank = node_of(name)
            if group_rank is None:
                continue
            try:
                part = parse_part(_read_small(directory / part_name(group_rank)), step,
                                  group_rank)
            except OSError:
                continue
            if part is not None:
                parts.append(part)
        marker = merge(parts)
        if marker is None:
            return False
        _atomic_write(directory / MARKER, marker.encode(), tag)
        _fsync_dir(directory)
        return True

    def _prune(self) -> None:
        present = self._steps()
        complete = [s for s in present if (self.path / step_dir(s) / MARKER).exists()]
        for step in to_prune(complete, present):
            shutil.rmtree(self.path / step_dir(step), ignore_errors=True)


def read_region(path: Path, size: int, target_fd: int) -> int:
    """Copy the file at ``path`` (``size`` bytes) into the region ``target_fd``; returns
    the snapshot's checksum read back from it (``zipformat.directory_checksum``), or -1
    if it does not hold a finished snapshot."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        if os.fstat(fd).st_size != size:
            return -1
        _copy_range(fd, target_fd, size)
    finally:
        os.close(fd)
    with mmap.mmap(target_fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as mapped, \
            memoryview(mapped) as view:
        checksum = zipformat.directory_checksum(view, size)
    return -1 if checksum is None else checksum


def _check_region(fd: int, slot: Slot) -> None:
    """The region still holds the snapshot its worker reported (its checksum: every
    record's CRC-32 and size); a stray write since then is never persisted."""
    with mmap.mmap(fd, slot.size, mmap.MAP_SHARED, mmap.PROT_READ) as mapped, \
            memoryview(mapped) as view:
        found = zipformat.directory_checksum(view, slot.size)
    if found != slot.checksum:
        raise OSError(errno.EIO, f"{slot.name} no longer holds step {slot.step} as its "
                      "worker reported it (checksum)")


def file_size(path: Path) -> int:
    st = os.stat(path, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(f"{path} is not a regular file")
    return st.st_size


def _stream_into(target: Path, source_fd: int, size: int) -> None:
    temporary = target.with_name(f".{target.name}.part")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
                 | os.O_NOFOLLOW, 0o600)
    try:
        _copy_range(source_fd, fd, size)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    os.close(fd)
    os.rename(temporary, target)


def _copy_range(source: int, target: int, size: int) -> None:
    """``size`` bytes from the start of ``source`` to the start of ``target`` (a fresh
    file, or a region at position 0), in the kernel: no copy through our memory.
    ``copy_file_range`` refuses some pairs of file systems (EXDEV): then ``sendfile``."""
    done = 0
    while done < size:
        try:
            moved = os.copy_file_range(source, target, size - done, done, done)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
            os.lseek(target, done, os.SEEK_SET)
            moved = os.sendfile(target, source, done, size - done)
        if moved == 0:
            raise OSError(errno.EIO, f"short copy: {done} of {size} bytes")
        done += moved


def _atomic_write(path: Path, data: bytes, tag: str = "") -> None:
    temporary = path.with_name(f".{path.name}.{tag}.part")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
                 | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(temporary, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_small(path: Path, limit: int = 1 << 20) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)
