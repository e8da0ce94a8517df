"""Goodput accounting: where a run's wall time went, and what each failure cost.

Pure code: no clock, no I/O, no event loop. The edge (``supervisor.accounting``) feeds
the ``Accountant`` with monotonic timestamps taken where things happened (a worker's
exit, a deadline's expiry, a rank's first progress in an attempt) and renders what it
returns; ``totals(ledger, now)`` turns a frozen ``Ledger`` into figures at any moment.

Wall time is cut into consecutive segments, each of one kind:

- **start-up**: from the supervisor's start until every awaited rank of the first
  attempt showed progress (or the first failure, whichever comes first);
- **productive**: every awaited rank has shown progress in the current attempt and
  nothing has failed since;
- **lost**, by cause: from a failure (for a hang or D state: from the rank's last
  progress, not from the moment it was noticed) until progress resumed, i.e. every
  awaited rank of the new attempt showed progress again;
- **idle**: neither (waiting at the exit barrier, stopping for a shutdown, after the end);
- **unknown**: after a launch, while no rank of the attempt has a progress signal: the
  time may be productive or still lost to the last failure, nobody can tell.

Progress means what ``ProgressTable`` says it means (a deadline post or heartbeat, or a
line matching ``--progress-pattern``); the accountant hears each rank's first progress per
attempt. Which ranks
are awaited after a launch: every rank that may have a progress signal, i.e. all but
those known to have none. A rank is known to have none once an attempt ran
``bound`` seconds (the progress timeout) past its launch without the rank showing any;
it is known to have one once it showed progress. When the bound passes with awaited
ranks still silent, the attempt counts as progressing from the last first-progress of
the ranks that did show some (or from its launch if none did), and the record lists the
silent ranks as ``missing``. When no awaited rank has a signal at all (none ever showed
progress in this run), nothing says when the attempt began to progress: from its launch
the time is **unknown**, and so is the record's resumption (outcome ``unknown``: its
``lost`` is None, ``lost_at_least`` the part until the relaunch). A run with unknown time
has no goodput ratio.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import msgspec

CAUSES = (
    "exit_code", "signal", "hang", "dstate", "node_lost", "node_joined", "remote_failure",
    "node_quarantined", "spare_admitted", "node_check", "other",
)
"""Every cause a failure or membership change is accounted under (metrics labels)."""

SIGNAL_YES = "progress"
SIGNAL_NONE = "none"
SIGNAL_UNKNOWN = "unknown"


class Kind(enum.Enum):
    """What the current segment of wall time is accounted as."""

    STARTUP = "startup"
    PRODUCTIVE = "productive"
    LOST = "lost"
    IDLE = "idle"
    UNKNOWN = "unknown"  # no rank has a progress signal: productive or lost, unseen


class Outcome(enum.Enum):
    """How a failure record ended."""

    OPEN = "open"  # still recovering
    RECOVERED = "recovered"  # every awaited rank showed progress again
    FAILED_AGAIN = "failed_again"  # another failure came before progress resumed
    ENDED = "ended"  # the run ended (gave up, shutdown) before progress resumed
    UNKNOWN = "unknown"  # relaunched, but no rank has a signal: resumption not seen


class Recovery(msgspec.Struct, frozen=True):
    """One failure or membership change and its phases (monotonic seconds)."""

    number: int  # 1-based, in order of failures in this run
    cause: str  # one of CAUSES
    attempt: int  # the attempt that failed
    failed_at: float  # when it went wrong (last progress for a hang)
    noticed_at: float  # when the supervisor saw it
    local_rank: int | None = None
    stopped_at: float | None = None
    launched_at: float | None = None
    resumed_at: float | None = None
    ended_at: float | None = None
    outcome: Outcome = Outcome.OPEN
    awaited: tuple[int, ...] = ()  # ranks whose progress the resumption waited for
    missing: tuple[int, ...] = ()  # awaited ranks silent until the bound passed
    no_signal: tuple[int, ...] = ()  # ranks known to have no progress signal
    message: str = ""
    # training-state snapshots (supervisor.snapshots): what the relaunch restored
    restored_step: int | None = None
    steps_redone: int | None = None  # newest step saved before the failure - restored
    work_lost: float | None = None  # seconds from the restored step's save to the failure
    state_from: str | None = None  # "memory" or "disk"

    @property
    def lost(self) -> float | None:
        """Seconds from the failure to the end of the record (None while open, or when
        the resumption was not seen)."""
        if self.ended_at is None or self.outcome is Outcome.UNKNOWN:
            return None
        return self.ended_at - self.failed_at

    @property
    def lost_at_least(self) -> float | None:
        """What is known to be lost when the resumption was not seen: until the relaunch."""
        return _minus(self.launched_at, self.failed_at)

    def phases(self) -> dict[str, float | None]:
        """Durations: failure->noticed, ->group stopped, ->new group launched, ->resumed."""
        return {
            "detect": self.noticed_at - self.failed_at,
            "stop": _minus(self.stopped_at, self.noticed_at),
            "relaunch": _minus(self.launched_at, self.stopped_at),
            "resume": _minus(self.resumed_at, self.launched_at),
        }


class Ledger(msgspec.Struct, frozen=True):
    """The accountant's state at one moment, for readers (``totals`` computes figures)."""

    started_at: float
    kind: Kind  # the open segment
    since: float
    cause: str | None = None  # of the open segment, when LOST
    startup: float = 0.0  # closed segments' sums
    productive: float = 0.0
    idle: float = 0.0
    unknown: float = 0.0
    lost: tuple[tuple[str, float], ...] = ()
    ended_at: float | None = None
    failures: int = 0
    restarts: int = 0  # failure restarts counted (the state machine's: /status's "used")
    attempt: int = 0
    launched_at: float | None = None  # of the current attempt
    awaiting: tuple[int, ...] = ()  # awaited ranks of the current attempt not yet seen
    signals: tuple[tuple[int, str], ...] = ()  # local rank -> SIGNAL_*
    last: Recovery | None = None  # the latest failure record, open or closed
    seen: bool = False  # some rank showed progress in this run: the figures can be known


class Totals(msgspec.Struct, frozen=True):
    """Figures of a run so far (seconds)."""

    wall: float
    startup: float
    productive: float
    lost: float
    lost_by_cause: dict[str, float]
    idle: float
    failures: int
    restarts: int
    unknown: float = 0.0
    seen: bool = True  # some rank showed progress: else start-up, productive and lost
    # time and the ratio cannot be known (nothing says when, or whether, work was done)

    @property
    def known(self) -> bool:
        """Whether the time figures (start-up, productive, lost, ratio) can be known."""
        return self.seen and self.unknown == 0

    @property
    def ratio(self) -> float | None:
        """Effective training time ratio: productive / wall (None before any time passed,
        or when it cannot be known: no rank had a progress signal)."""
        return self.productive / self.wall if self.wall > 0 and self.known else None


def totals(ledger: Ledger, now: float) -> Totals:
    """The run's figures at ``now`` (the open segment counts up to ``now``)."""
    end = ledger.ended_at if ledger.ended_at is not None else max(now, ledger.since)
    open_part = max(0.0, end - ledger.since)
    sums = {k: 0.0 for k in Kind}
    sums[Kind.STARTUP] = ledger.startup
    sums[Kind.PRODUCTIVE] = ledger.productive
    sums[Kind.IDLE] = ledger.idle
    sums[Kind.UNKNOWN] = ledger.unknown
    lost = dict(ledger.lost)
    if ledger.kind is Kind.LOST:
        cause = ledger.cause or "other"
        lost[cause] = lost.get(cause, 0.0) + open_part
    else:
        sums[ledger.kind] += open_part
    return Totals(
        wall=max(0.0, end - ledger.started_at),
        startup=sums[Kind.STARTUP],
        productive=sums[Kind.PRODUCTIVE],
        lost=sum(lost.values()),
        lost_by_cause=lost,
        idle=sums[Kind.IDLE],
        failures=ledger.failures,
        restarts=ledger.restarts,
        unknown=sums[Kind.UNKNOWN],
        seen=ledger.seen,
    )


class Accountant:
    """Cuts a run's wall time into segments and keeps one record per failure.

    Every input returns the failure records it closed (to be reported once each).
    ``bound`` is how long after a launch a silent awaited rank is waited for.
    """

    def __init__(self, started_at: float, bound: float) -> None:
        self.bound = bound
        self._started = started_at
        self._kind = Kind.STARTUP
        self._cause: str | None = None
        self._since = started_at
        self._sums = {Kind.STARTUP: 0.0, Kind.PRODUCTIVE: 0.0, Kind.IDLE: 0.0, Kind.UNKNOWN: 0.0}
        self._lost = dict.fromkeys(CAUSES, 0.0)
        self._ended: float | None = None
        self._signals: dict[int, str] = {}  # absent: unknown
        self._open: Recovery | None = None
        self._last: Recovery | None = None
        self._failures = 0
        self._restarts = 0  # failure restarts counted by the state machine (``counted``)
        # the current attempt
        self._attempt = 0
        self._launched_at: float | None = None
        self._ranks: frozenset[int] = frozenset()
        self._awaited: frozenset[int] = frozenset()
        self._first: dict[int, float] = {}
        self._running = False  # its group runs: progress and failures count
        self._waiting = False  # its resumption (or the start-up) is not settled yet

    # ------------------------------------------------------------------ inputs
    def launched(self, attempt: int, ranks: Iterable[int], at: float) -> list[Recovery]:
        """A worker group was launched with these local ranks."""
        if self._ended is not None:
            return []
        if self._open is not None:
            self._open = msgspec.structs.replace(self._open, launched_at=at)
            self._last = self._open
        self._attempt = attempt
        self._launched_at = at
        self._ranks = frozenset(ranks)
        self._awaited = frozenset(r for r in self._ranks if self._signals.get(r) != SIGNAL_NONE)
        self._first = {}
        self._running = True
        self._waiting = self._kind in (Kind.STARTUP, Kind.LOST)
        return self._settle(at, force=False)

    def restored(self, step: int, newest: int | None, saved_at: float | None,
                 source: str) -> None:
        """The attempt about to launch restores snapshot ``step`` (saved, complete on
        every rank, at ``saved_at``; ``newest``: the newest step any rank had saved)."""
        if self._open is None:
            return
        failed_at = self._open.failed_at
        self._open = msgspec.structs.replace(
            self._open, restored_step=step, state_from=source,
            steps_redone=None if newest is None else max(0, newest - step),
            work_lost=None if saved_at is None else max(0.0, failed_at - saved_at))
        self._last = self._open

    def progress(self, attempt: int, local_rank: int, at: float) -> list[Recovery]:
        """A rank of ``attempt`` showed progress (only its first time per attempt matters)."""
        if attempt != self._attempt or not self._running or local_rank in self._first:
            return []
        if local_rank not in self._ranks:
            return []
        self._first[local_rank] = at
        self._signals[local_rank] = SIGNAL_YES
        if self._kind is Kind.UNKNOWN:  # a signal at last: from here on it is seen
            self._close_segment(at, Outcome.ENDED)
            self._kind, self._cause, self._since = Kind.PRODUCTIVE, None, max(at, self._since)
            return []
        return self._settle(at, force=False)

    def failed(
        self,
        cause: str,
        noticed_at: float,
        *,
        local_rank: int | None = None,
        last_progress: float | None = None,
        message: str = "",
    ) -> list[Recovery]:
        """The running group failed (or its membership changed); its stop begins.

        For a hang or D state, ``last_progress`` (the rank's last progress, monotonic) is
        when the time started being lost. A failure while no group runs is ignored (the
        first failure of an attempt is its root cause; the rest is consequence).
        """
        if self._ended is not None or not self._running:
            return []
        failed_at = noticed_at
        if cause in ("hang", "dstate") and last_progress is not None:
            failed_at = last_progress
        # never before the open segment (that time is accounted already) nor after noticing
        failed_at = min(max(failed_at, self._since), noticed_at)
        closed = self._close_segment(failed_at, Outcome.FAILED_AGAIN)
        self._failures += 1
        self._open = Recovery(
            number=self._failures, cause=cause if cause in CAUSES else "other",
            attempt=self._attempt, failed_at=failed_at, noticed_at=noticed_at,
            local_rank=local_rank, message=message,
        )
        self._last = self._open
        self._kind, self._cause, self._since = Kind.LOST, self._open.cause, failed_at
        self._running = self._waiting = False
        return closed

    def relabel(self, cause: str, message: str = "") -> None:
        """The open failure turned out to be of another cause (a local failure that was a
        remote consequence: it is learned while the group stops)."""
        if self._open is None or cause not in CAUSES:
            return
        self._open = msgspec.structs.replace(self._open, cause=cause,
                                             message=message or self._open.message)
        self._last = self._open
        if self._kind is Kind.LOST:
            self._cause = cause

    def counted(self, restarts: int) -> None:
        """The failure restarts used so far (the state machine's count, which ``/status``
        shows as used): the one restart figure everywhere."""
        self._restarts = restarts

    def stopped(self, at: float) -> None:
        """The group is stopped (every worker gone)."""
        self._running = self._waiting = False
        if self._open is not None and self._open.stopped_at is None:
            self._open = msgspec.structs.replace(self._open, stopped_at=at)
            self._last = self._open

    def paused(self, at: float, *, settle: bool) -> list[Recovery]:
        """No more progress is expected for now (every worker exited 0, or a shutdown).

        ``settle``: the workers finished, so an unsettled start-up or recovery is settled
        with the progress seen so far; otherwise (a shutdown) it ends unrecovered.
        """
        if self._ended is not None:
            return []
        closed = self._settle(at, force=True) if settle and self._running else []
        if self._blind_wait():  # stopped before anything could be seen
            closed += self._unseen(at)
        closed += self._close_segment(at, Outcome.ENDED)
        self._kind, self._cause, self._since = Kind.IDLE, None, max(at, self._since)
        self._running = self._waiting = False
        return closed

    def finished(self, at: float) -> list[Recovery]:
        """The run ended; nothing accrues after ``at``."""
        if self._ended is not None:
            return []
        closed = self.paused(at, settle=False)
        self._ended = self._since
        return closed

    def poll(self, now: float) -> list[Recovery]:
        """Settle a resumption whose bound has passed by ``now``."""
        return self._settle(now, force=False)

    # ------------------------------------------------------------------ reading
    def deadline(self) -> float | None:
        """When ``poll`` would settle the current wait by its bound (None: no wait)."""
        if not (self._waiting and self._running) or self._launched_at is None:
            return None
        return self._launched_at + self.bound

    def signal_of(self, local_rank: int) -> str:
        """``SIGNAL_YES``, ``SIGNAL_NONE`` or ``SIGNAL_UNKNOWN`` for a local rank."""
        return self._signals.get(local_rank, SIGNAL_UNKNOWN)

    def ledger(self) -> Ledger:
        """A frozen copy of the state, for readers."""
        waiting = self._waiting and self._running
        return Ledger(
            started_at=self._started, kind=self._kind, since=self._since, cause=self._cause,
            startup=self._sums[Kind.STARTUP], productive=self._sums[Kind.PRODUCTIVE],
            idle=self._sums[Kind.IDLE], unknown=self._sums[Kind.UNKNOWN],
            lost=tuple(self._lost.items()),
            ended_at=self._ended, failures=self._failures,
            restarts=self._restarts, attempt=self._attempt,
            launched_at=self._launched_at,
            awaiting=tuple(sorted(self._awaited - self._first.keys())) if waiting else (),
            signals=tuple(sorted((r, self.signal_of(r)) for r in self._ranks)),
            last=self._last,
            seen=SIGNAL_YES in self._signals.values(),
        )

    # ------------------------------------------------------------------ internals
    def _settle(self, now: float, *, force: bool) -> list[Recovery]:
        """End the wait for progress if every awaited rank showed some, or by the bound."""
        if not (self._waiting and self._running) or self._launched_at is None:
            return []
        pending = self._awaited - self._first.keys()
        if pending and not force and now < self._launched_at + self.bound:
            return []
        # silent past the bound: known to progress elsewhen, so missing; or no signal at all
        missing = frozenset(r for r in pending if self._signals.get(r) == SIGNAL_YES)
        if not force:
            for rank in pending - missing:
                self._signals[rank] = SIGNAL_NONE
        seen = [self._first[r] for r in self._awaited if r in self._first]
        if not seen and not missing:  # no rank has a signal: when it resumed is not seen
            return self._unseen(now)
        resumed = max(max(seen, default=self._launched_at), self._since)
        self._waiting = False
        closed: list[Recovery] = []
        if self._kind is Kind.STARTUP:
            self._sums[Kind.STARTUP] += resumed - self._since
        elif self._kind is Kind.LOST and self._open is not None:
            self._add_lost(resumed)
            closed.append(self._close_record(resumed, Outcome.RECOVERED, resumed, missing))
        self._kind, self._cause, self._since = Kind.PRODUCTIVE, None, resumed
        return closed

    def _blind_wait(self) -> bool:
        """Waiting for progress that no rank of the attempt can show (no signal known)."""
        return (self._waiting and self._running and not self._first
                and not any(self._signals.get(r) == SIGNAL_YES for r in self._ranks))

    def _unseen(self, now: float) -> list[Recovery]:
        """From the launch on, the time is unknown; an open record ends ``unknown``."""
        assert self._launched_at is not None
        launched = min(max(self._launched_at, self._since), now)
        self._waiting = False
        closed: list[Recovery] = []
        if self._kind is Kind.STARTUP:
            self._sums[Kind.STARTUP] += launched - self._since
        elif self._kind is Kind.LOST:
            self._add_lost(launched)
            if self._open is not None:
                closed.append(self._close_record(launched, Outcome.UNKNOWN, None, frozenset()))
        elif self._kind is not Kind.UNKNOWN:
            self._sums[self._kind] += launched - self._since
        if self._kind is not Kind.UNKNOWN:
            self._kind, self._cause, self._since = Kind.UNKNOWN, None, launched
        return closed

    def _close_segment(self, at: float, outcome: Outcome) -> list[Recovery]:
        """Account the open segment up to ``at``; an open record ends with ``outcome``."""
        at = max(at, self._since)
        if self._kind is Kind.LOST:
            self._add_lost(at)
            if self._open is not None:
                return [self._close_record(at, outcome, None, frozenset())]
            return []
        self._sums[self._kind] += at - self._since
        return []

    def _add_lost(self, until: float) -> None:
        cause = self._cause or "other"
        self._lost[cause] = self._lost.get(cause, 0.0) + max(0.0, until - self._since)

    def _close_record(
        self, at: float, outcome: Outcome, resumed: float | None, missing: frozenset[int]
    ) -> Recovery:
        assert self._open is not None
        record = msgspec.structs.replace(
            self._open, resumed_at=resumed, ended_at=at, outcome=outcome,
            awaited=tuple(sorted(self._awaited)) if resumed is not None else (),
            missing=tuple(sorted(missing)),
            no_signal=tuple(sorted(r for r in self._ranks
                                   if self._signals.get(r) == SIGNAL_NONE)),
        )
        self._open = None
        self._last = record
        return record


def cause_of_membership(reason: str) -> str:
    """The cause of a membership change, from the rendezvous' reason text."""
    text = reason.lower()
    if "spare(s) waiting" in text and ("quarantined" in text or "lost" in text):
        return "spare_admitted"  # a spare takes the place of a node that left
    if "quarantined" in text:
        return "node_quarantined"
    if ("lost" in text and "rendezvous lost" not in text) or "cut off from etcd" in text:
        return "node_lost"  # another node was lost, or this one (the cut-off rule)
    if "join" in text:
        return "node_joined"
    if "another node" in text or "closed" in text:
        return "remote_failure"
    return "other"


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b
