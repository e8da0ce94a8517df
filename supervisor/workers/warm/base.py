"""What the worker group needs of a warm pool (``Pool``), the pool that has no standbys
(``NullPool``: ``--no-warm-restart``, a run that can have no second attempt, tests of the
group alone), and the first attempt as the group can tell it before the rendezvous
(``Preview``). ``pool.WarmPool`` is the real one: imported only when a run uses it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from supervisor.workers.spawn import Start, Worker, WorkerSpec

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from supervisor.workers.attempt import Attempt
    from supervisor.workers.warm.memory import MemorySample


class Pool(Protocol):
    """What the worker group needs of a pool of standbys."""

    def begin(self, attempt: Attempt) -> None:
        """``attempt`` is about to start its ranks (``take`` serves it)."""

    async def ready(self, local_rank: int) -> None:
        """Before ``take``: wait (briefly, bounded) for the rank's standby to be ready."""

    def take(self, spec: WorkerSpec) -> Worker | None:
        """The rank's worker started in its standby; None: start it cold."""

    def cold_start(self, local_rank: int) -> Start:
        """How a rank ``take`` gave no worker for starts (cold, and why if it had one)."""

    def launched(self, attempt: Attempt) -> None:
        """``attempt``'s ranks are started (standbys without preloading are planned now)."""

    async def run(self, attempt: Attempt) -> None:
        """Start the standbys for the attempt after ``attempt``, when due."""

    async def halt(self, attempt: Attempt | None = None) -> None:
        """Start no further standby; wait for the spawn in flight. ``attempt``: the one
        stopping (what it showed of rank 0's store is learned)."""

    def pids(self) -> set[int]:
        """The standbys' pids (a group's sweep must not kill them)."""

    def close(self) -> None:
        """Kill and reap every standby."""

    async def start_tasks(self, tg: TaskGroup) -> None:
        """Start the pool's run-long tasks (the fork server's) in the root task group."""

    def warm_up(self, preview: Preview | None) -> None:
        """Prepare what the first attempt (or its restart) will need (before the
        rendezvous)."""

    async def settle(self) -> None:
        """Before a restart's launch: have the standbys that are still to come (the fork
        server importing) when waiting for them is sooner than starting cold."""

    def memory(self) -> MemorySample | None:
        """The last reading of the fork server's and the forked standbys' memory."""

    def fork_failures(self) -> dict[str, int]:
        """Fork servers that failed in this run, by reason."""


class NullPool:
    """No standbys: every worker starts cold (``--no-warm-restart``)."""

    def begin(self, attempt: Attempt) -> None:
        return None

    async def ready(self, local_rank: int) -> None:
        return None

    def take(self, spec: WorkerSpec) -> Worker | None:
        return None

    def cold_start(self, local_rank: int) -> Start:
        return Start()

    def launched(self, attempt: Attempt) -> None:
        return None

    async def run(self, attempt: Attempt) -> None:
        return None

    async def halt(self, attempt: Attempt | None = None) -> None:
        return None

    def pids(self) -> set[int]:
        return set()

    def close(self) -> None:
        return None

    async def start_tasks(self, tg: TaskGroup) -> None:
        return None

    def warm_up(self, preview: Preview | None) -> None:
        return None

    async def settle(self) -> None:
        return None

    def memory(self) -> MemorySample | None:
        return None

    def fork_failures(self) -> dict[str, int]:
        return {}


@dataclass(frozen=True)
class Preview:
    """The first attempt's ranks as the worker group can tell them before the rendezvous:
    rank 0's command, every rank's environment (per-attempt values are placeholders) and
    CPUs."""

    argv: list[str]
    envs: list[dict[str, str]]
    cpus: list[tuple[int, ...] | None]
