"""How a standby is supplied: forked from the node's fork server, or started as a process
of its own that imports for itself. Both behind one protocol, ``Supplier``: requests in,
standbys out, blocking (the pool calls it on the spawner thread).

``ForkedSupply`` asks the ready fork server for a batch in one request (milliseconds each;
``forkserver_main._fork_each`` has them set themselves up one after another);
``SpawnedSupply`` starts each requested standby with ``standby.spawn_standby`` (with
``--preload auto``, the rank's list as ``AutoLearner`` learned it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from supervisor.core.envs import interpreter
from supervisor.workers.spawn import DeathSignal
from supervisor.workers.warm import autopreload
from supervisor.workers.warm.forkserver import Wanted
from supervisor.workers.warm.standby import Standby, StandbyOptions, spawn_standby

if TYPE_CHECKING:
    from supervisor.workers.warm.autolearn import AutoLearner
    from supervisor.workers.warm.forkslot import ForkSlot

logger = logging.getLogger(__name__)


@dataclass
class StandbyRequest:
    """One standby to supply: its rank, environment, cwd, CPUs; what ``auto`` learns from."""

    rank: int
    env: dict[str, str]
    cwd: str | None
    cpus: tuple[int, ...] | None
    rank_dir: Path
    pid: int  # the rank's current worker (its imports are what ``auto`` preloads)
    warm: bool
    exclude: frozenset[str]  # packages ``auto`` must leave out (read a per-attempt var)
    path0: str | None = None  # the cold command's sys.path[0] (``forkserver.cold_path0``)


class Supplier(Protocol):
    """A way of supplying standbys."""

    def supply(self, requests: Sequence[StandbyRequest]) -> list[Standby | None]:
        """A standby per request, in their order; None: that rank starts cold. Blocking."""


class ForkedSupply:
    """Standbys forked by the node's fork server (``ForkSlot``'s ready one)."""

    def __init__(self, forks: ForkSlot, python: str) -> None:
        self.forks = forks
        self.python = python
        self.forked_from: dict[int, int] = {}  # local rank -> pid of the server it came from

    def supply(self, requests: Sequence[StandbyRequest]) -> list[Standby | None]:
        """Fork ``requests`` in one request to the server."""
        for request in requests:
            self.forked_from.pop(request.rank, None)
        server = self.forks.server
        forked = self.forks.fork([Wanted(r.rank, r.env, r.cpus) for r in requests])
        if server is None or forked is None:
            return [None] * len(requests)
        standbys: list[Standby | None] = []
        config = server.config
        for request, one in zip(requests, forked, strict=True):
            if one is None:
                standbys.append(None)
                continue
            logger.debug("standby for local rank %d forked as pid %d by the fork server "
                         "(pid %d)", request.rank, one.process.pid, server.pid)
            self.forked_from[request.rank] = server.pid
            standbys.append(Standby(one.process, one.sock, interpreter(self.python),
                                    request.env, (*config.preload, *config.auto_names),
                                    forked=True))
        return standbys


class SpawnedSupply:
    """Standbys started as processes of their own, each doing its own preload."""

    def __init__(self, python: str, death: DeathSignal, options: StandbyOptions,
                 learner: AutoLearner) -> None:
        self.python = python
        self.death = death
        self.options = options
        self.learner = learner

    def supply(self, requests: Sequence[StandbyRequest]) -> list[Standby | None]:
        return [self._spawn(request) for request in requests]

    def _spawn(self, request: StandbyRequest) -> Standby | None:
        spec = self._auto_spec(request) if self.options.auto else None
        try:
            return spawn_standby(
                request.rank, self.python, request.env, self.death, cwd=request.cwd,
                cpus=request.cpus, options=self.options, auto_spec=spec, path0=request.path0,
            )
        except OSError as exc:
            autopreload.remove_spec(spec)
            logger.warning("cannot start a standby for local rank %d: %s", request.rank, exc)
            return None

    def _auto_spec(self, request: StandbyRequest) -> str | None:
        return self.learner.rank_spec(request.rank, request.rank_dir, request.pid,
                                      request.warm, request.exclude)
