"""The watchdog: deadline tailer (``timers``), FIFO I/O (``fifo``), escalation, D state."""

from __future__ import annotations

from supervisor.watchdog.dstate import DStateMonitor, DStateTracker
from supervisor.watchdog.escalate import ExpiryOutcome, HangDump, ProcessHandle
from supervisor.watchdog.fifo import FifoError, LineBuffer, open_fifo_reader
from supervisor.watchdog.owners import OwnerCache, owner_by_ancestry
from supervisor.watchdog.timers import (
    Watchdog,
    WatchdogConfig,
    WatchdogMetrics,
    WatchdogStats,
)

__all__ = [
    "DStateMonitor",
    "DStateTracker",
    "ExpiryOutcome",
    "FifoError",
    "HangDump",
    "LineBuffer",
    "OwnerCache",
    "ProcessHandle",
    "Watchdog",
    "WatchdogConfig",
    "WatchdogMetrics",
    "WatchdogStats",
    "open_fifo_reader",
    "owner_by_ancestry",
]
