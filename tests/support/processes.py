"""Waiting on processes the tests did not start themselves (workers, grandchildren)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import anyio


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def wait_dead(pids: Sequence[int], timeout: float) -> None:
    """Wait until every pid is gone; pidfds make this event-driven where possible."""
    with anyio.fail_after(timeout):
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            try:
                if pid_alive(pid):
                    await anyio.wait_readable(fd)  # a pidfd is readable once the process exits
            finally:
                os.close(fd)
