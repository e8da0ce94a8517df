"""A real full disk for tests: a small tmpfs mounted for the duration of a ``with``."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(point: Path, size: str = "1m", inodes: int | None = None) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (and ``inodes``) at ``point`` (created), unmount after.

    Skips the test when mounting is not allowed: it needs root (as the tests run here) or
    CAP_SYS_ADMIN.
    """
    point.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (f",nr_inodes={inodes}" if inodes is not None else "")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (run the tests as root): {done.stderr.strip()}")
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], capture_output=True, check=False)


def fill(directory: Path, name: str = "filler") -> Path:
    """Write zeros into ``directory/name`` until the file system is full; returns the file."""
    path = directory / name
    block = b"\0" * 65536
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                written = f.write(block)
            except OSError:
                break
            if not written:
                break
    with contextlib.suppress(OSError), open(path, "ab", buffering=0) as f:
        while f.write(b"\0"):  # the last partial page
            pass
    return path
