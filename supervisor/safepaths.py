"""Opening log files below ``--log-dir`` without following a symlink planted there.

``--log-dir`` may be shared (``/tmp``, a cluster-wide log volume): another user who can
write it could pre-create the job's run directory, or put a symlink at
``RUN_ID/events.jsonl`` or ``attempt_K/0/stdout.log``, and the supervisor (often root)
would append the job's events or a worker's output to whatever the link names. So every
path below the log directory is walked one component at a time from a directory file
descriptor, each opened with ``O_NOFOLLOW`` (a symlink is refused with ``ELOOP``), and the
run directory must belong to the supervisor's user and not be writable by its group or
others. The log directory itself may be a symlink: an administrator made it.

A worker (same user) can also replace a log file with a FIFO or a device node: opened for
writing, a FIFO blocks until someone reads it, which once hung the daemon's SIGHUP reopen
and the next start. So every file is opened with ``O_NONBLOCK`` (a FIFO without a reader
fails at once with ``ENXIO``), checked with ``fstat`` to be a regular file (a FIFO with a
reader, a device), and only then set blocking again; a directory holding it below the
log directory must not be writable by its group or others.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NONBLOCK
_FILE = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC  # added to every file open
APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
CREATE_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC


def _refused(path: Path, exc: OSError) -> OSError:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        return OSError(errno.ELOOP, f"{path} is a symbolic link or not a directory; refused "
                                    "below the log directory", str(path))
    if exc.errno == errno.ENXIO:  # O_NONBLOCK write-open of a FIFO nobody reads, a device
        return _not_regular(path, "a FIFO or a device")
    return exc


def _not_regular(path: Path, kind: str) -> OSError:
    return OSError(errno.EINVAL, f"{path} is {kind}, not a regular file; refused",
                   str(path))


_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket",
          stat.S_IFDIR: "a directory"}


def _checked_file(fd: int, path: Path) -> int:
    """``fd`` (opened non-blocking) if it is a regular file, set blocking again; closed
    and refused otherwise."""
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, _KINDS.get(stat.S_IFMT(mode), "not a regular file"))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file_at(dir_fd: int, name: str, path: Path, flags: int, mode: int = 0o640) -> int:
    """Open the regular file ``name`` in ``dir_fd`` (``path``, for messages): never
    through a symlink, never blocking on a FIFO, refused unless a regular file."""
    try:
        fd = os.open(name, flags | _FILE, mode, dir_fd=dir_fd)
    except OSError as exc:
        raise _refused(path, exc) from None
    return _checked_file(fd, path)


def open_dir_below(root: Path, rel: Path, *, create: bool = False, mode: int = 0o755) -> int:
    """A descriptor of the directory ``root/rel``; no component of ``rel`` may be a
    symlink. ``create``: make the missing ones (``mode``, filtered by the umask)."""
    fd = os.open(root, _DIR)
    here = root
    try:
        for part in rel.parts:
            if part in ("", ".", "..") or "/" in part:
                raise OSError(errno.EINVAL, f"{rel}: not a plain relative path", str(rel))
            here = here / part
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, mode, dir_fd=fd)
            child = open_subdir(fd, part, here)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_subdir(dir_fd: int, name: str, path: Path) -> int:
    """A descriptor of directory ``name`` inside ``dir_fd`` (``path``, for messages),
    refusing a symlink."""
    try:
        return os.open(name, _DIR | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:
        raise _refused(path, exc) from None


def open_below(root: Path, path: Path, flags: int = APPEND, mode: int = 0o640, *,
               create_dirs: bool = False) -> int:
    """Open ``path`` (below ``root``) without following a symlink anywhere below ``root``.
    A path outside ``root`` (an ``--event-log`` of its own) refuses a symlink only as its
    last component."""
    try:
        rel = path.relative_to(root)
    except ValueError:
        rel = None
    if rel is None or not rel.parts:
        if create_dirs:
            path.parent.mkdir(parents=True, exist_ok=True)
        root, rel = path.parent, Path(path.name)
    dir_fd = open_dir_below(root, rel.parent, create=create_dirs)
    try:
        if rel.parent.parts:  # a directory of the job's, not one an administrator chose
            check_private_dir(dir_fd, root / rel.parent)
        return open_file_at(dir_fd, rel.name, path, flags, mode)
    finally:
        os.close(dir_fd)


def open_in_dir(path: Path, flags: int = CREATE_NEW, mode: int = 0o640) -> int:
    """Open ``path`` in a directory of the job's (a rank directory), which must not be a
    symlink itself and must be private (``check_private_dir``); the file as in
    ``open_below``. By default a new file: ``O_EXCL``, nothing planted is reused."""
    dir_fd = _open_private_parent(path)
    try:
        return open_file_at(dir_fd, path.name, path, flags, mode)
    finally:
        os.close(dir_fd)


def replace_file(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write ``path`` whole through a temporary name and rename it into place (a reader
    never sees half of it), in a directory ``open_in_dir`` accepts. A name planted at the
    temporary one (a FIFO, a link) is removed first, never opened."""
    tmp = f".{path.name}.{os.getpid()}"
    dir_fd = _open_private_parent(path)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        fd = open_file_at(dir_fd, tmp, path.parent / tmp, CREATE_NEW, mode)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
    finally:
        os.close(dir_fd)


def _open_private_parent(path: Path) -> int:
    """A descriptor of ``path``'s directory, itself not a symlink, checked private."""
    parent = path.parent
    top = os.open(parent.parent, _DIR)
    try:
        dir_fd = open_subdir(top, parent.name, parent)
    finally:
        os.close(top)
    try:
        check_private_dir(dir_fd, parent)
    except BaseException:
        os.close(dir_fd)
        raise
    return dir_fd


def check_private_dir(fd: int, path: Path) -> None:
    """Raise ``PermissionError`` unless the directory ``fd`` belongs to our effective uid
    and neither its group nor others can write it (someone else made it, or may plant
    files in it)."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise PermissionError(errno.EPERM, f"{path} belongs to uid {st.st_uid}, not to this "
                                           f"supervisor's uid {os.geteuid()}", str(path))
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        whom = "others" if st.st_mode & stat.S_IWOTH else "its group"
        raise PermissionError(errno.EPERM, f"{path} is writable by {whom} "
                                           f"(mode {stat.S_IMODE(st.st_mode):o})", str(path))


def prepare_run_dir(root: Path, run_id: str) -> None:
    """Create (or find) ``root/run_id`` and check it is ours and private (see above)."""
    fd = open_dir_below(root, Path(run_id), create=True)
    try:
        check_private_dir(fd, root / run_id)
    finally:
        os.close(fd)
