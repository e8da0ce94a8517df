"""One attempt of the worker group, as the group, its pool and its watch share it: a leaf
the warm pool's protocol can name without importing the group."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import anyio
import msgspec

from supervisor.core.envs import GroupLayout
from supervisor.rendezvous.base import RendezvousResult
from supervisor.workers.spawn import Worker


class WorkerFailure(msgspec.Struct, frozen=True):
    """A worker that failed before its group began to stop (the run's typed result)."""

    local_rank: int
    global_rank: int
    pid: int
    exit_code: int | None
    signal: str | None  # its name (SIGKILL), when it died by one
    message: str
    at_wall: float


@dataclass(eq=False)
class Attempt:
    """One incarnation of the worker group."""

    number: int
    dir_index: int
    directory: Path
    round: RendezvousResult
    layout: GroupLayout
    workers: list[Worker] = field(default_factory=list)
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    kill_now: anyio.Event = field(default_factory=anyio.Event)
    stopping: bool = False  # set when its stop is decided: no new standbys from then on
    # set once ``WorkerGroup.start`` is done with it (every rank started, or it stopped
    # starting them because a stop was decided meanwhile): a stop waits for it
    started: anyio.Event = field(default_factory=anyio.Event)
    # workers that failed before the stop was decided, in the order their exits were seen
    failures: list[WorkerFailure] = field(default_factory=list)

    def error_file(self, local_rank: int) -> Path:
        return self.directory / str(local_rank) / "error.json"
