"""elastic-supervisor: a per-node supervisor for gang-scheduled worker groups.

``supervisor.launch`` / ``supervisor.alaunch`` (the Python API, see ``supervisor.api``) are
imported on first use: workers import ``supervisor.worker`` and the bootstrap from this
package and must not pay for the supervisor's own dependencies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from supervisor.version import __version__

if TYPE_CHECKING:
    from supervisor.api import RankFailure, WorkerGroupFailed, alaunch, launch

__all__ = ["RankFailure", "WorkerGroupFailed", "__version__", "alaunch", "launch"]

_API = frozenset({"RankFailure", "WorkerGroupFailed", "alaunch", "launch"})


def __getattr__(name: str) -> Any:
    if name in _API:
        from supervisor import api

        return getattr(api, name)
    raise AttributeError(f"module 'supervisor' has no attribute {name!r}")
