"""Creating an attempt's log directory, ``RUN_ID/attempt_K/LOCAL_RANK/``, exclusively.

The next attempt's directory has a predictable name. If it were reused when present, a
worker of this attempt (or anyone who can write the run directory) could plant files for
its successor: a fake ``error.json`` that becomes the next failure's root cause, or a
symlink at ``stdout.log`` that sends the next worker's output elsewhere. So
``attempt_K`` is made with ``mkdir`` and must not exist before; an index that is taken
is skipped (the directory is left alone, never deleted), up to ``MAX_SKIPPED`` of them.
The rank directories inside are created by us right after, inside a directory nobody
else has had the chance to write into.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import msgspec

from supervisor.safepaths import check_private_dir, open_dir_below, open_subdir

logger = logging.getLogger(__name__)

DIR_MODE = 0o755  # filtered by the umask, as torchrun's (the units set UMask=0027)
MAX_SKIPPED = 1000  # a run directory full of planted names: give up rather than loop


class AttemptDir(msgspec.Struct, frozen=True):
    """A freshly created attempt directory: its index K and path ``RUN_DIR/attempt_K``."""

    index: int
    path: Path

    def rank_dir(self, local_rank: int) -> Path:
        """``attempt_K/LOCAL_RANK``, created with the attempt."""
        return self.path / str(local_rank)


def create_attempt_dir(run_dir: Path, index: int, local_world_size: int, *,
                       root: Path | None = None) -> AttemptDir:
    """Create ``run_dir/attempt_K`` (K >= ``index``, the first free one) and its rank dirs.

    ``run_dir`` itself is created if missing and may exist, but must be ours and not
    writable by others, and is reached from ``root`` (default: its parent, the log
    directory) without following a symlink (``safepaths``): a run directory swapped for
    a link while the job runs is refused like one that cannot be made. Raises ``OSError``
    when the directories cannot be made (ENOSPC, EDQUOT, EACCES, ELOOP, ...): the caller
    reports that as a supervisor-side failure, not a worker's. ``FileExistsError`` is
    raised only when ``MAX_SKIPPED`` indexes in a row are taken.
    """
    if index < 0:
        raise ValueError(f"attempt index must be >= 0, got {index}")
    root = run_dir.parent if root is None else root
    if root == run_dir.parent:
        root.mkdir(parents=True, exist_ok=True)
    run_fd = open_dir_below(root, run_dir.relative_to(root), create=True)
    try:
        check_private_dir(run_fd, run_dir)
        return _create_in(run_fd, run_dir, index, local_world_size)
    finally:
        os.close(run_fd)


def _create_in(run_fd: int, run_dir: Path, index: int, local_world_size: int) -> AttemptDir:
    for k in range(index, index + MAX_SKIPPED + 1):
        name = f"attempt_{k}"
        try:
            os.mkdir(name, DIR_MODE, dir_fd=run_fd)
        except FileExistsError:
            continue
        if k != index:
            logger.warning("%s existed before this attempt; left alone, using %s",
                           run_dir / f"attempt_{index}", name)
        created = AttemptDir(k, run_dir / name)
        try:
            attempt_fd = open_subdir(run_fd, name, created.path)
            try:
                for local_rank in range(local_world_size):
                    os.mkdir(str(local_rank), DIR_MODE, dir_fd=attempt_fd)
            finally:
                os.close(attempt_fd)
        except OSError:
            _remove_empty(created, local_world_size)  # a retry may use the same index
            raise
        return created
    raise FileExistsError(
        f"{run_dir}: attempt_{index} .. attempt_{index + MAX_SKIPPED} all exist already"
    )


def _remove_empty(created: AttemptDir, local_world_size: int) -> None:
    """Undo a half-made attempt directory; only empty directories go (rmdir)."""
    for local_rank in range(local_world_size):
        with contextlib.suppress(OSError):
            os.rmdir(created.rank_dir(local_rank))
    try:
        os.rmdir(created.path)
    except OSError as exc:
        logger.debug("could not remove the half-made %s: %s", created.path, exc)
