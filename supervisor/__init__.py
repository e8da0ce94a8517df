"""elastic-supervisor: a per-node supervisor for gang-scheduled worker groups."""

from __future__ import annotations

__version__ = "0.1.0"
