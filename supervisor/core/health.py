"""Health verdicts and the ``/status`` document, computed from a published view.

Pure code: the caller passes the view, the progress times, the clock reading and the
measured event-loop lag, so every verdict is reproducible in a unit test. The HTTP
server (``supervisor.health.server``) turns these into responses.

Liveness answers "is this supervisor stuck?": the event loop must be responsive and
every running worker that ever reported progress must have done so recently. It stays
true while the supervisor waits (rendezvous, backoff, stopping, exit barrier), because
waiting is not being stuck and a restart of the supervisor would only make things worse.

Readiness answers "is the worker group running?": true only in the RUNNING phase with
no failed worker. With ``ready_when = "progress"`` (the default setting) it also waits
for progress: a rank that showed progress in an earlier attempt of this run is expected
to show it again in the current one before the node is ready, for at most the progress
timeout after the launch; a rank never seen progressing (no deadline posts, no output
through the supervisor, or the first attempt) is ready at launch, as with ``launched``.
A failure makes the node unready at once: the phase leaves RUNNING when it is noticed.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import msgspec

from supervisor.core.goodput import Ledger, Outcome, Recovery, totals
from supervisor.core.statusview import FailureView, RendezvousView, StatusView, WorkerView
from supervisor.version import __version__

UNKNOWN = "unknown"  # a phase or figure no progress signal let us see

DEFAULT_MAX_LOOP_LAG = 5.0
"""Seconds of event-loop lag above which the supervisor is reported not live."""

_RUNNING = "running"


class Verdict(msgspec.Struct, frozen=True):
    """One probe's answer: ``ok`` and a short human reason."""

    ok: bool
    reason: str

    def as_json(self) -> dict[str, Any]:
        """The small JSON body served by ``/healthz`` and ``/readyz``."""
        return {"ok": self.ok, "reason": self.reason}


def liveness(
    view: StatusView,
    progress: Mapping[int, float],
    now_mono: float,
    loop_lag: float,
    *,
    max_loop_lag: float = DEFAULT_MAX_LOOP_LAG,
) -> Verdict:
    """Whether the supervisor is alive: responsive loop and recent worker progress."""
    if loop_lag > max_loop_lag:
        return Verdict(False, f"event loop lag {loop_lag:.3f} s exceeds {max_loop_lag:.3f} s")
    stale = stale_ranks(view, progress, now_mono)
    if stale:
        rank, age = stale[0]
        more = f" (and {len(stale) - 1} more)" if len(stale) > 1 else ""
        return Verdict(
            False,
            f"local rank {rank} made no progress for {age:.1f} s"
            f" (timeout {view.progress_timeout:.1f} s){more}",
        )
    return Verdict(True, f"alive ({view.phase})")


def stale_ranks(
    view: StatusView, progress: Mapping[int, float], now_mono: float
) -> list[tuple[int, float]]:
    """Running local ranks whose last progress is older than the timeout, oldest first.

    Only judged while the group runs: in other phases the workers are absent, stopping
    or done, so their last progress is expected to age. Ranks that never posted
    progress are not judged (they may not use deadlines at all).
    """
    timeout = view.progress_timeout
    if view.phase != _RUNNING or timeout <= 0:
        return []
    finished = {w.local_rank for w in view.workers if w.state != _RUNNING}
    ages = [
        (rank, now_mono - last)
        for rank, last in progress.items()
        if rank not in finished and now_mono - last > timeout
    ]
    return sorted(ages, key=lambda item: -item[1])


def readiness(
    view: StatusView,
    *,
    shown: Collection[int] = frozenset(),
    expected: Collection[int] = frozenset(),
    now_mono: float | None = None,
) -> Verdict:
    """Whether the worker group is running healthy (and so ready for traffic).

    ``shown``: local ranks that showed progress in the current attempt; ``expected``:
    ranks that showed progress in an earlier attempt (see ``ProgressTable``).
    """
    if view.phase != _RUNNING:
        return Verdict(False, f"not running: {view.phase}")
    failed = [w.local_rank for w in view.workers if w.state == "failed"]
    if failed:
        return Verdict(False, f"local rank {failed[0]} failed")
    waiting = awaited_ranks(view, shown, expected, now_mono)
    if waiting:
        ranks = ", ".join(str(r) for r in waiting)
        return Verdict(False, f"waiting for progress from local rank(s) {ranks}")
    if view.ready_when == "progress" and not shown and not expected:
        # nothing to wait for can tell when it trains: ready means launched, said so
        return Verdict(True, "running (no rank has shown progress: ready at launch; "
                             "--progress-pattern gives a progress signal)")
    return Verdict(True, "running")


def awaited_ranks(
    view: StatusView,
    shown: Collection[int],
    expected: Collection[int],
    now_mono: float | None,
) -> list[int]:
    """Running ranks readiness still waits for (empty unless ``ready_when`` is progress)."""
    if view.ready_when != "progress" or view.phase != _RUNNING:
        return []
    launched = view.goodput.launched_at if view.goodput is not None else None
    if (
        launched is not None
        and now_mono is not None
        and now_mono - launched >= view.progress_timeout
    ):
        return []  # bounded: a rank silent this long is left to liveness
    running = {w.local_rank for w in view.workers if w.state == _RUNNING}
    return sorted(r for r in expected if r in running and r not in shown)


def ready_and_live(
    view: StatusView,
    progress: Mapping[int, float],
    now_mono: float,
    loop_lag: float,
    *,
    max_loop_lag: float = DEFAULT_MAX_LOOP_LAG,
    shown: Collection[int] = frozenset(),
    expected: Collection[int] = frozenset(),
) -> Verdict:
    """The ``/readyz`` verdict: ready, and not stuck (a stuck group is not ready either)."""
    ready = readiness(view, shown=shown, expected=expected, now_mono=now_mono)
    if not ready.ok:
        return ready
    live = liveness(view, progress, now_mono, loop_lag, max_loop_lag=max_loop_lag)
    return live if not live.ok else ready  # a ready body says "running", not "alive"


# ------------------------------------------------------------------------------ status


def status_document(
    view: StatusView,
    progress: Mapping[int, float],
    now_mono: float,
    *,
    now_wall: float | None = None,
    shown: Collection[int] = frozenset(),
    expected: Collection[int] = frozenset(),
) -> dict[str, Any]:
    """The ``/status`` JSON document. Never contains environment, commands or secrets.

    ``now_wall`` (epoch seconds) gives the uptime; without it ``uptime`` is ``null``.
    ``shown`` and ``expected`` are the readiness inputs (see ``readiness``).
    """
    rdzv = view.rendezvous
    uptime = None if now_wall is None else max(0.0, now_wall - view.started_at_wall)
    return {
        "run_id": view.run_id,
        "version": __version__,
        "role": view.role,
        "node_rank": rdzv.group_rank,
        "group_world_size": rdzv.group_world_size,
        "state": view.phase,
        "status": view.status_line,
        "attempt": view.attempt,
        "restarts": {
            "used": view.restart_count,
            "max": view.max_restarts,
            "left": view.restarts_left,
        },
        "world_size": view.world_size,
        "local_world_size": view.local_world_size,
        "workers": [_worker_json(w, progress, now_mono) for w in view.workers],
        "last_failure": _failure_json(view.last_failure),
        "rendezvous": _rendezvous_json(rdzv),
        "watchdog": {
            "enabled": view.watchdog_enabled,
            "progress_timeout": view.progress_timeout,
        },
        "readiness": {
            "ready_when": view.ready_when,
            "awaiting_progress": awaited_ranks(view, shown, expected, now_mono),
        },
        "goodput": goodput_json(view.goodput, now_mono, now_wall),
        "node_health": view.node_health,
        "snapshots": view.snapshots,
        "exit_code": view.exit_code,
        "started_at": view.started_at_wall,
        "uptime": _round(uptime),
        "snapshot_age": _round(max(0.0, now_mono - view.published_at)),
        "stale_events": view.stale_events,
    }


def _worker_json(
    worker: WorkerView, progress: Mapping[int, float], now_mono: float
) -> dict[str, Any]:
    last = progress.get(worker.local_rank)
    return {
        "local_rank": worker.local_rank,
        "global_rank": worker.global_rank,
        "pid": worker.pid,
        "state": worker.state,
        "started_at": worker.started_at,
        "exit_code": worker.exit_code,
        "signal": worker.signal,
        "cpu_affinity": None if worker.cpu_affinity is None else list(worker.cpu_affinity),
        "last_progress_age": None if last is None else _round(max(0.0, now_mono - last)),
    }


def _failure_json(failure: FailureView | None) -> dict[str, Any] | None:
    if failure is None:
        return None
    return {
        "kind": failure.kind,
        "attempt": failure.attempt,
        "local_rank": failure.local_rank,
        "global_rank": failure.global_rank,
        "pid": failure.pid,
        "exit_code": failure.exit_code,
        "signal": failure.signal,
        "message": failure.message,
        "description": failure.description,
        "at": failure.at_wall,
        "error_file": failure.error_file,
    }


def _rendezvous_json(rdzv: RendezvousView) -> dict[str, Any]:
    return {
        "backend": rdzv.backend,
        "round": rdzv.round,
        "members": list(rdzv.members),
        "group_rank": rdzv.group_rank,
        "group_world_size": rdzv.group_world_size,
        "duration": rdzv.last_duration,
        "etcd": rdzv.etcd,
    }


def goodput_json(
    ledger: Ledger | None, now_mono: float, now_wall: float | None
) -> dict[str, Any] | None:
    """The ``goodput`` block: totals so far and the latest failure's record."""
    if ledger is None:
        return None
    t = totals(ledger, now_mono)
    # no rank has shown progress: nothing says when (or whether) work was done
    seen: Any = (lambda value: value) if t.seen else (lambda value: UNKNOWN)
    ratio = None if t.ratio is None else round(t.ratio, 4)
    return {
        "wall": _round(t.wall),
        "startup": seen(_round(t.startup)),
        "productive": seen(_round(t.productive)),
        "lost": seen(_round(t.lost)),
        "lost_by_cause": seen({k: _round(v) for k, v in t.lost_by_cause.items()}),
        "idle": _round(t.idle),
        "unknown": _round(t.unknown),
        "ratio": UNKNOWN if ratio is None and not t.known else ratio,
        "failures": t.failures,
        "restarts": t.restarts,
        "segment": ledger.kind.value,
        "progress_signals": {str(rank): signal for rank, signal in ledger.signals},
        "last_recovery": recovery_json(ledger.last, now_mono, now_wall),
    }


def recovery_json(
    record: Recovery | None, now_mono: float, now_wall: float | None
) -> dict[str, Any] | None:
    """One failure record as JSON: cause, phases, time lost; wall-clock times if known."""
    if record is None:
        return None
    offset = None if now_wall is None else now_wall - now_mono

    def wall(mono: float | None) -> float | None:
        return None if mono is None or offset is None else round(mono + offset, 6)

    lost = record.lost
    unseen = record.outcome is Outcome.UNKNOWN  # no progress signal: say so, not a figure
    phases: dict[str, float | str | None] = {
        k: None if v is None else round(v, 6) for k, v in record.phases().items()}
    if unseen:
        phases["resume"] = UNKNOWN
    return {
        "number": record.number,
        "cause": record.cause,
        "attempt": record.attempt,
        "local_rank": record.local_rank,
        "outcome": record.outcome.value,
        "failed_at": wall(record.failed_at),
        "noticed_at": wall(record.noticed_at),
        "stopped_at": wall(record.stopped_at),
        "launched_at": wall(record.launched_at),
        "resumed_at": wall(record.resumed_at),
        "phases": phases,
        "lost": UNKNOWN if unseen else None if lost is None else round(lost, 6),
        "lost_at_least": _round6(record.lost_at_least) if unseen else None,
        "awaited": list(record.awaited),
        "missing": list(record.missing),
        "no_signal": list(record.no_signal),
        "message": record.message or None,
        "restored_step": record.restored_step,
        "steps_redone": record.steps_redone,
        "work_lost": _round6(record.work_lost),
        "state_from": record.state_from,
    }


def _round6(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
