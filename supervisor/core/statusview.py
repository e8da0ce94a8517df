"""The supervisor's status as readers see it (HTTP, systemd notify, the ``status`` CLI).

Readers never touch live state: the read model (``supervisor.views.ReadModel``) builds a
new immutable ``StatusView`` after each transition (and when goodput, healing or the etcd
connection change what is shown) and swaps it in. Progress times are the one exception,
kept in a ``ProgressTable`` that only the watchdog, the output pumps and the snapshot
channel write and readers only read, so a busy FIFO does not republish the view.

(Not to be confused with ``supervisor.snapshots``: copies of the workers' training state.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import msgspec.structs

from supervisor.core.goodput import Ledger

MAX_MESSAGE_CHARS = 4096
"""The longest failure ``message`` and ``description`` a status view keeps, in characters.

A worker's error file may hold a message of up to 1 MiB, and ``description`` repeats it:
uncapped, ``/status`` answered 2 MB to every prober. The full text stays in the error
file (its path is in the view); readers get the first ``MAX_MESSAGE_CHARS`` characters
and a marker saying how many were left out.
"""


def cap_text(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` if it fits in ``limit`` characters, else its head and a truncation marker.

    The result is never longer than ``limit`` characters (for ``limit`` >= 64: the marker
    takes at most 46 of them).
    """
    if len(text) <= limit:
        return text
    keep = max(0, limit - 64)
    return f"{text[:keep]} ... [{len(text) - keep} more characters cut]"


class WorkerView(msgspec.Struct, frozen=True):
    local_rank: int
    global_rank: int
    pid: int | None
    state: str  # "running", "succeeded", "failed", "stopped"
    started_at: float | None  # wall clock, epoch seconds
    exit_code: int | None = None
    signal: int | None = None
    cpu_affinity: tuple[int, ...] | None = None


class FailureView(msgspec.Struct, frozen=True):
    kind: str
    attempt: int
    local_rank: int | None
    global_rank: int | None
    pid: int | None
    exit_code: int | None
    signal: int | None
    message: str
    description: str
    at_wall: float
    error_file: str | None = None

    def __post_init__(self) -> None:
        # capped here, where every reader's copy is made: /status, STATUS=, the summary
        for name in ("message", "description"):
            text = getattr(self, name)
            if len(text) > MAX_MESSAGE_CHARS:
                msgspec.structs.force_setattr(self, name, cap_text(text))


class RendezvousView(msgspec.Struct, frozen=True):
    backend: str
    round: int = 0
    members: tuple[str, ...] = ()
    group_rank: int = 0
    group_world_size: int = 1
    last_duration: float | None = None
    etcd: dict[str, Any] | None = None  # reachability and outages, for the etcd backends


class StatusView(msgspec.Struct, frozen=True):
    """What the supervisor looks like right now, as of ``published_at`` (monotonic)."""

    run_id: str
    phase: str
    attempt: int
    restart_count: int
    max_restarts: int
    restarts_left: int
    world_size: int
    local_world_size: int
    role: str
    published_at: float
    started_at_wall: float
    workers: tuple[WorkerView, ...] = ()
    last_failure: FailureView | None = None
    rendezvous: RendezvousView = msgspec.field(default_factory=lambda: RendezvousView("static"))
    watchdog_enabled: bool = False
    progress_timeout: float = 60.0
    status_line: str = ""
    exit_code: int | None = None
    # goodput and readiness (supervisor.core.goodput, health.readiness)
    goodput: Ledger | None = None
    ready_when: str = "launched"  # "launched" or "progress"
    node_health: dict[str, Any] | None = None  # healing: checks, spare, quarantine (healing.py)
    stale_events: int = 0  # earlier attempts' events dropped so far (core.state.is_stale)
    snapshots: dict[str, Any] | None = None  # training-state snapshots (supervisor.snapshots)


ProgressListener = Callable[[int, int, float], None]
"""Hears each rank's first progress of an attempt: ``(attempt, local_rank, monotonic)``."""


class ProgressTable:
    """Progress of the current attempt's local ranks (monotonic times).

    One definition of progress, used by liveness, readiness and goodput alike: a deadline
    post or heartbeat (``touch``, from the watchdog); for a rank that never posted one in
    this run, its first output line matching ``--progress-pattern`` (``touch_output``, from
    the output pumps, only when its output passes through the supervisor). A bare first
    line is not progress: a real torch job prints while it starts (torch's warnings during
    ``import torch``, a script's "starting" line; a warm standby prints at once), so it
    would mark a rank progressing seconds before it trains. Otherwise a rank has no
    progress signal, and goodput says "unknown" for what it cannot see.

    Written only by the watchdog and the output pumps; read by the health verdicts.
    ``reset`` is called by the controller when a new attempt launches so stale ranks are
    not judged. Only deadline posts age into "no progress for N s" (``view``): a rank that
    printed one matching line is not expected to print more.
    """

    def __init__(self) -> None:
        self._last: dict[int, float] = {}  # last deadline post, this attempt
        self._first: dict[int, float] = {}  # first progress of any kind, this attempt
        self._posters: set[int] = set()  # ranks that posted a deadline in this run
        self._ever: set[int] = set()  # ranks that showed progress in any attempt
        self.expected: frozenset[int] = frozenset()  # showed it in an earlier attempt
        self.attempt = 0
        # called with (attempt, local rank, time) at a rank's first progress of an attempt
        # (no I/O: the goodput recorder, the warm pool's wait for every rank)
        self.listeners: list[ProgressListener] = []

    def reset(self, attempt: int) -> None:
        self.attempt = attempt
        self._last = {}
        self._first = {}
        self.expected = frozenset(self._ever)

    def touch(self, local_rank: int, now: float) -> None:
        """A deadline post or heartbeat of ``local_rank`` at ``now``."""
        self._last[local_rank] = now
        self._posters.add(local_rank)
        if local_rank not in self._first:
            self._shown(local_rank, now)

    def touch_output(self, local_rank: int, now: float) -> None:
        """A line of ``local_rank`` matching ``--progress-pattern``, read at ``now``."""
        if local_rank in self._first or local_rank in self._posters:
            return
        self._shown(local_rank, now)

    def touch_save(self, local_rank: int, now: float) -> None:
        """A snapshot save of ``local_rank`` completed at ``now``: progress for readiness
        and goodput, not for liveness (a job may save every few minutes)."""
        if local_rank not in self._first:
            self._shown(local_rank, now)

    def _shown(self, local_rank: int, now: float) -> None:
        self._first[local_rank] = now
        self._ever.add(local_rank)
        for listener in list(self.listeners):
            listener(self.attempt, local_rank, now)

    def count(self) -> int:
        """How many ranks of the current attempt have shown progress (of any kind)."""
        return len(self._first)

    def view(self) -> Mapping[int, float]:
        """Last deadline post per rank of this attempt (what liveness judges)."""
        return dict(self._last)

    def shown(self) -> frozenset[int]:
        """Ranks that showed progress (of any kind) in this attempt."""
        return frozenset(self._first)

    def last_progress(self, local_rank: int) -> float | None:
        """When ``local_rank`` last showed progress in this attempt, if it did."""
        return self._last.get(local_rank, self._first.get(local_rank))
