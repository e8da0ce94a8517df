"""What the fork server and the standbys cost in memory, for ``/metrics``.

RSS counts every page a process maps, shared or not: a forked standby maps the server's
preloaded pages too, so its RSS says little. USS (the pages only it holds: the
``Private_*`` lines of ``/proc/PID/smaps_rollup``) is what it adds. Reading
``smaps_rollup`` walks the process's page tables (milliseconds for a torch process), so
``MemorySampler`` reads in a worker thread, at most once per ``interval``, and the
metrics only show the last sample: a scrape never waits for ``/proc``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import anyio
import anyio.to_thread
import msgspec

INTERVAL = 10.0  # seconds between two samples at most
IDLE_LOOK = 1.0  # seconds between two looks for something to sample


class MemorySample(msgspec.Struct, frozen=True):
    """One reading: bytes, None where a process was gone."""

    at: float  # monotonic
    server_rss: int | None
    standby_uss: dict[int, int]  # local rank -> USS


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def uss_bytes(pid: int) -> int | None:
    total, seen = 0, False
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith((b"Private_Clean:", b"Private_Dirty:")):
                    total += int(line.split()[1]) * 1024
                    seen = True
    except (OSError, ValueError, IndexError):
        return None
    return total if seen else None


def sample(server: int | None, standbys: Mapping[int, int]) -> MemorySample:
    """Read the server's RSS and each standby's USS (``standbys``: local rank -> pid)."""
    uss = {rank: value for rank, pid in standbys.items()
           if (value := uss_bytes(pid)) is not None}
    return MemorySample(time.monotonic(), rss_bytes(server) if server else None, uss)


class MemorySampler:
    """Keeps a recent ``MemorySample`` of the processes ``targets`` names."""

    def __init__(self, targets: Callable[[], tuple[int | None, dict[int, int]]],
                 interval: float = INTERVAL) -> None:
        self.targets = targets
        self.interval = interval
        self.last = MemorySample(0.0, None, {})

    async def run(self) -> None:
        """Sample every ``interval`` seconds, off the loop, until cancelled."""
        while True:
            server, standbys = self.targets()
            if server is not None or standbys:
                self.last = await anyio.to_thread.run_sync(sample, server, standbys)
                await anyio.sleep(self.interval)
            else:  # nothing to read yet: look again soon (no I/O until there is)
                self.last = MemorySample(time.monotonic(), None, {})
                await anyio.sleep(IDLE_LOOK)
