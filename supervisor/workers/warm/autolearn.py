"""What ``--preload auto`` has learned in this run: the node's list (the fork server
imports it), each rank's (its next spawned standby imports it) and the packages never to
preload (they read a per-attempt variable while they imported).

The rule is in ``autopreload`` (which reads and writes the files); this holds what was
learned and decides when to learn again. Reads are blocking: the pool calls them in a
worker thread.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from supervisor.workers.warm import autopreload

if TYPE_CHECKING:
    from supervisor.workers.attempt import Attempt

logger = logging.getLogger(__name__)


class AutoLearner:
    """``--preload auto``'s lists for one run.

    ``run_dir``: where the node's list is kept for the next run with the same log
    directory and run id (None: nothing is kept, under spawned standbys)."""

    def __init__(self, run_dir: Path | None = None) -> None:
        self.node: list[str] | None = None  # the node's list (the fork server's)
        self.by_rank: dict[int, list[str]] = {}  # local rank -> its last worker's imports
        self.excluded: set[str] = set()  # packages that read a per-attempt variable
        self._learned_first = False  # from this run's first attempt
        self._refined = False  # again from a warm attempt's own record
        self._run_dir = run_dir
        self._kept: tuple[list[str], set[str]] = ([], set())
        if run_dir is not None:
            self._kept = autopreload.read_kept(run_dir)
            self.node = list(self._kept[0]) or None
            self.excluded |= self._kept[1]

    def due(self, attempt: Attempt) -> bool:
        """Whether to learn the node's list from ``attempt``: the run's first, and once
        more the first whose ranks all ran warm: a cold worker's list is the shared
        libraries it mapped (``torch``), a warm one records the modules it imported,
        pure-Python ones too (DDP imports ``torch._dynamo`` at its first use: seconds that
        a preload saves)."""
        if not self._learned_first:
            return True
        if self._refined or not attempt.workers \
                or not all(w.start.warm for w in attempt.workers):
            return False
        self._refined = True
        return True

    def learn_node(self, attempt: Attempt) -> bool:
        """Add what ``attempt``'s workers imported to the node's list (blocking: reads
        their records or maps); whether the list changed (a new server should import it)."""
        learned = self._node_names(attempt)
        self._learned_first = True
        names = list(dict.fromkeys([*(self.node or ()), *learned]))
        changed = bool(names) and names != self.node
        self.node = names
        return changed

    def _node_names(self, attempt: Attempt) -> list[str]:
        """What the attempt's workers imported, in order, every rank's."""
        found: dict[str, None] = {}
        for worker in attempt.workers:
            rank_dir = attempt.directory / str(worker.local_rank)
            names = autopreload.read_record(rank_dir) if worker.start.warm else []
            if not names and not worker.reaped:  # a reaped worker's pid may be another's now
                names = autopreload.cold_worker_modules(worker.pid)
            found.update(dict.fromkeys(names))
        logger.debug("--preload auto learned %d module(s) for the node: %s", len(found),
                     ",".join(list(found)[:8]) + ("..." if len(found) > 8 else ""))
        return list(found)

    def to_keep(self, also_excluded: set[str]) -> tuple[Path, list[str], set[str]] | None:
        """``autopreload.keep``'s arguments: the run directory, the node's list and the
        packages found tainted (with ``also_excluded``, the fork servers'), for the next
        run; None when there is nothing new since the last call (which notes what it
        returns as kept)."""
        kept = (list(self.node or ()), self.excluded | also_excluded)
        if self._run_dir is None or kept == self._kept or not kept[0]:
            return None
        self._kept = kept
        return self._run_dir, *kept

    def rank_spec(self, rank: int, rank_dir: Path, pid: int, warm: bool,
                  exclude: frozenset[str]) -> str | None:
        """The file with the auto list of a rank's next spawned standby (None: nothing to
        import), learned from its current worker ``pid``: its record if it ran warm, else
        the libraries it mapped (blocking: reads files)."""
        names = autopreload.read_record(rank_dir) if warm else []
        source = "its record"
        if not names:
            names, source = autopreload.cold_worker_modules(pid), "its mapped libraries"
        if names:
            self.by_rank[rank] = names
            logger.debug("local rank %d: --preload auto learned %d module(s) from %s of "
                         "pid %d: %s", rank, len(names), source, pid,
                         ",".join(names[:8]) + ("..." if len(names) > 8 else ""))
        names = self.by_rank.get(rank, [])
        if not names:
            return None
        try:
            return autopreload.write_spec(names, set(exclude))
        except OSError as exc:
            logger.warning("cannot write the preload list of local rank %d: %s", rank, exc)
            return None
