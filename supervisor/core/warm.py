"""Warm restarts, what is decided: whether standbys are worth their memory, when and how
they are supplied after a launch, which ranks get one and from where, why a rank starts
cold, when a warm rank waits for rank 0's store, and how long a restart waits for a fork
server still importing.

Pure: facts in, decisions out; ``workers/warm/pool.py`` gathers the facts and acts. The
rules are in docs/design.md ("Warm restarts").
"""

from __future__ import annotations

import enum
from collections.abc import Container, Iterable, Mapping, Sequence

from supervisor.core.envs import fork_mismatch

TAINT_RETRIES = 3  # new standbys per rank after auto preloads that read a per-attempt variable
STORE_WAIT = 5.0  # seconds a warm rank waits for rank 0's store before it dials anyway
# s a restart waits for a fork server still importing when this node has not yet seen what
# a cold start costs (no progress shown): a preload that hangs delays one restart by this
UNKNOWN_COLD_WAIT = 60.0
PRELOAD_FAILED = "preload_failed"  # a cold start's reason (the metric's label)


def attempt_may_follow(restart_count: int, max_restarts: int,
                       membership_can_change: bool) -> bool:
    """Whether another attempt may follow the one with ``restart_count`` (so standbys are
    worth their memory): failure restarts left, or a backend whose membership can change."""
    return membership_can_change or restart_count < max_restarts


class Supply(enum.Enum):
    """How the next attempt's standbys come, once an attempt is launched."""

    NONE = "none"  # no attempt may follow: no standby is worth its memory
    FORK = "fork"  # forked from the node's fork server right after the launch
    START = "start"  # started right after the launch (they import nothing themselves)
    # preloading standbys that import for themselves (no fork server): once the ranks have
    # resumed, not to compete with them for the CPU
    WHEN_RESUMED = "when_resumed"


def plan_at_launch(may_follow: bool, preloading: bool, forking: bool) -> bool:
    """Whether the standbys are planned at the launch itself, before any event of the
    attempt is handled (a stop that begins before they are started then waits for the
    spawn): when they come right after it (``Supply.FORK``, ``Supply.START``)."""
    return may_follow and (not preloading or forking)


def supply_after_launch(may_follow: bool, planned: bool, forking: bool) -> Supply:
    """How the standbys ``plan_at_launch`` planned (or not) come. ``forking``: as it is
    now (the fork server may have been given up since the launch: they are started)."""
    if not may_follow:
        return Supply.NONE
    if planned:
        return Supply.FORK if forking else Supply.START
    return Supply.WHEN_RESUMED


def ranks_wanting(runs_warm: Iterable[tuple[int, bool]], held: Container[int]) -> list[int]:
    """The local ranks that get a standby for the next attempt, in order: those whose
    command can run warm (``runs_warm``: (rank, whether it can)) and that hold none."""
    return [rank for rank, warm in runs_warm if warm and rank not in held]


def split_by_source(envs: Sequence[tuple[int, Mapping[str, str]]], forking: bool,
                    server_env: Mapping[str, str] | None) -> tuple[list[int], list[int]]:
    """The ranks (of (rank, standby environment)) the fork server forks, and those that get
    a started standby: a rank whose environment is not the node's, or every rank without
    the fork server. While forking, none starts without a ready server (``server_env``
    None: cold starts)."""
    if not forking:
        return [], [rank for rank, _ in envs]
    if server_env is None:
        return [], []
    forked = [rank for rank, env in envs if fork_mismatch(server_env, env) is None]
    return forked, [rank for rank, _ in envs if rank not in forked]


def cold_reason(runs_warm: bool, changed: str | None,
                preload_failure: str | None) -> tuple[str, str] | None:
    """Why a standby cannot take its rank's worker, as (metric label, log text), or None.
    ``changed``: the first variable that differs from what the standby started with."""
    if not runs_warm:
        return "other", "its command cannot run in a standby"
    if changed is not None:
        return "env_changed", f"environment variable {changed} changed since its standby started"
    if preload_failure is not None:
        return PRELOAD_FAILED, preload_failure
    return None


def store_to_await(store_seen: bool, rank_offset: int, global_rank: int,
                   master: tuple[str, int]) -> tuple[str, int, float] | None:
    """Where a preloaded warm rank waits for rank 0's store before the user's code dials it
    (host, port, at most seconds), or None: only once the job is known to use rank 0's
    store (``store_seen``), on rank 0's node (``rank_offset`` 0), for ranks other than 0.

    torch's store client that dials before the server listens is refused and retries
    after an exponential backoff (250-750 ms first), which is most of a warm restart's
    ``init_process_group``; rank 0 is handed over first."""
    if not store_seen or rank_offset != 0 or global_rank == 0:
        return None
    return master[0], master[1], STORE_WAIT


def settle_wait(cold_startup: float | None,
                import_seconds: float | None) -> tuple[float, bool]:
    """How long a restart waits for a fork server still importing rather than start cold,
    and whether that is what a cold start is known to cost: as long as this node's last
    cold start took from launch to every rank's progress; not seen yet, what the last
    ready server's import took; neither known, ``UNKNOWN_COLD_WAIT``."""
    limit = cold_startup or import_seconds
    return (UNKNOWN_COLD_WAIT, False) if limit is None else (limit, True)


def cold_startup_seen(all_cold: bool, ranks: int, progressed: int) -> bool:
    """Whether this progress completes what a cold start costs here: an attempt whose
    ``ranks`` all started cold and have all shown progress."""
    return ranks > 0 and all_cold and progressed >= ranks


def stale_forks(forked_from: Mapping[int, int], server_pid: int | None) -> list[int]:
    """The ranks whose standby was forked by another server than the ready one (before
    ``--preload auto`` learned the list that one imports): they are forked again."""
    return [rank for rank, pid in forked_from.items() if server_pid is None or pid != server_pid]


class ColdReasons:
    """Why ranks start cold: learned during an attempt (``note``), they are the next
    attempt's reasons once it begins (``begin``)."""

    def __init__(self) -> None:
        self.current: dict[int, str] = {}  # the attempt being started, then running
        self.pending: dict[int, str] = {}  # learned for the next one
        # ``begin`` counted the ranks waiting for a new fork server as cold for a failed
        # preload; the failure of that server's preload is then not counted again
        self.counted_early = False

    def note(self, rank: int, reason: str) -> None:
        self.pending[rank] = reason

    def begin(self, waiting: Iterable[int] = ()) -> None:
        """An attempt begins. ``waiting``: ranks whose standbys still wait for a new fork
        server, the last one's preload having failed: they start cold for that reason
        (also when the new server has not failed yet: it imports the same list)."""
        for rank in waiting:
            self.pending.setdefault(rank, PRELOAD_FAILED)
            self.counted_early = True
        self.current, self.pending = self.pending, {}

    def preload_failed(self, ranks: Iterable[int]) -> None:
        """The fork server's preload failed for these ranks' standbys (counted once)."""
        if not self.counted_early:
            for rank in ranks:
                self.pending[rank] = PRELOAD_FAILED

    def reason(self, rank: int, preload_failing: bool) -> str | None:
        """Why ``rank``, which got no worker from a standby, starts cold. ``preload_failing``:
        the node's fork server's last preload failed (however the restart and the server's
        retry raced: that is why there was no standby)."""
        reason = self.current.get(rank)
        if reason is None and preload_failing:
            return PRELOAD_FAILED
        return reason


class TaintRetries:
    """New standbys per rank after ``--preload auto`` preloads that were tainted: at most
    ``TAINT_RETRIES`` in a run, each without the package found reading."""

    def __init__(self, limit: int = TAINT_RETRIES) -> None:
        self.limit = limit
        self.used: dict[int, int] = {}

    def allow(self, rank: int) -> bool:
        """Whether ``rank`` may get another standby (counted if so)."""
        used = self.used.get(rank, 0)
        if used >= self.limit:
            return False
        self.used[rank] = used + 1
        return True
