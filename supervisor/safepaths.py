"""Opening log files below ``--log-dir`` without following a symlink planted there.

``--log-dir`` may be shared (``/tmp``, a cluster-wide log volume): another user who can
write it could pre-create the job's run directory, or put a symlink at
``RUN_ID/events.jsonl`` or ``attempt_K/0/stdout.log``, and the supervisor (often root)
would append the job's events or a worker's output to whatever the link names. So every
path below the log directory is walked one component at a time from a directory file
descriptor, each opened with ``O_NOFOLLOW`` (a symlink is refused with ``ELOOP``), and the
run directory must belong to the supervisor's user and not be writable by others. The log
directory itself may be a symlink: an administrator made it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC


def _refused(path: Path, exc: OSError) -> OSError:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        return OSError(errno.ELOOP, f"{path} is a symbolic link or not a directory; refused "
                                    "below the log directory", str(path))
    return exc


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
        return os.open(rel.name, flags | os.O_NOFOLLOW, mode, dir_fd=dir_fd)
    except OSError as exc:
        raise _refused(path, exc) from None
    finally:
        os.close(dir_fd)


def check_private_dir(fd: int, path: Path) -> None:
    """Raise ``PermissionError`` unless the directory ``fd`` belongs to our effective uid
    and others cannot write it (someone else made it, or may plant files in it)."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise PermissionError(errno.EPERM, f"{path} belongs to uid {st.st_uid}, not to this "
                                           f"supervisor's uid {os.geteuid()}", str(path))
    if st.st_mode & stat.S_IWOTH:
        raise PermissionError(errno.EPERM, f"{path} is writable by others "
                                           f"(mode {stat.S_IMODE(st.st_mode):o})", str(path))


def prepare_run_dir(root: Path, run_id: str) -> None:
    """Create (or find) ``root/run_id`` and check it is ours and private (see above)."""
    fd = open_dir_below(root, Path(run_id), create=True)
    try:
        check_private_dir(fd, root / run_id)
    finally:
        os.close(fd)
