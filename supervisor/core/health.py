"""Health verdicts and the ``/status`` document, computed from a published snapshot.

Pure code: the caller passes the snapshot, the progress times, the clock reading and the
measured event-loop lag, so every verdict is reproducible in a unit test. The HTTP
server (``supervisor.health.server``) turns these into responses.

Liveness answers "is this supervisor stuck?": the event loop must be responsive and
every running worker that ever reported progress must have done so recently. It stays
true while the supervisor waits (rendezvous, backoff, stopping, exit barrier), because
waiting is not being stuck and a restart of the supervisor would only make things worse.

Readiness answers "is the worker group running?": true only in the RUNNING phase with
no failed worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from supervisor import __version__
from supervisor.core.snapshot import FailureView, RendezvousView, Snapshot, WorkerView

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
    snapshot: Snapshot,
    progress: Mapping[int, float],
    now_mono: float,
    loop_lag: float,
    *,
    max_loop_lag: float = DEFAULT_MAX_LOOP_LAG,
) -> Verdict:
    """Whether the supervisor is alive: responsive loop and recent worker progress."""
    if loop_lag > max_loop_lag:
        return Verdict(False, f"event loop lag {loop_lag:.3f} s exceeds {max_loop_lag:.3f} s")
    stale = stale_ranks(snapshot, progress, now_mono)
    if stale:
        rank, age = stale[0]
        more = f" (and {len(stale) - 1} more)" if len(stale) > 1 else ""
        return Verdict(
            False,
            f"local rank {rank} made no progress for {age:.1f} s"
            f" (timeout {snapshot.progress_timeout:.1f} s){more}",
        )
    return Verdict(True, f"alive ({snapshot.phase})")


def stale_ranks(
    snapshot: Snapshot, progress: Mapping[int, float], now_mono: float
) -> list[tuple[int, float]]:
    """Running local ranks whose last progress is older than the timeout, oldest first.

    Only judged while the group runs: in other phases the workers are absent, stopping
    or done, so their last progress is expected to age. Ranks that never posted
    progress are not judged (they may not use deadlines at all).
    """
    timeout = snapshot.progress_timeout
    if snapshot.phase != _RUNNING or timeout <= 0:
        return []
    finished = {w.local_rank for w in snapshot.workers if w.state != _RUNNING}
    ages = [
        (rank, now_mono - last)
        for rank, last in progress.items()
        if rank not in finished and now_mono - last > timeout
    ]
    return sorted(ages, key=lambda item: -item[1])


def readiness(snapshot: Snapshot) -> Verdict:
    """Whether the worker group is running healthy (and so ready for traffic)."""
    if snapshot.phase != _RUNNING:
        return Verdict(False, f"not running: {snapshot.phase}")
    failed = [w.local_rank for w in snapshot.workers if w.state == "failed"]
    if failed:
        return Verdict(False, f"local rank {failed[0]} failed")
    return Verdict(True, "running")


def ready_and_live(
    snapshot: Snapshot,
    progress: Mapping[int, float],
    now_mono: float,
    loop_lag: float,
    *,
    max_loop_lag: float = DEFAULT_MAX_LOOP_LAG,
) -> Verdict:
    """The ``/readyz`` verdict: ready, and not stuck (a stuck group is not ready either)."""
    ready = readiness(snapshot)
    if not ready.ok:
        return ready
    return liveness(snapshot, progress, now_mono, loop_lag, max_loop_lag=max_loop_lag)


# ------------------------------------------------------------------------------ status


def status_document(
    snapshot: Snapshot,
    progress: Mapping[int, float],
    now_mono: float,
    *,
    now_wall: float | None = None,
) -> dict[str, Any]:
    """The ``/status`` JSON document. Never contains environment, commands or secrets.

    ``now_wall`` (epoch seconds) gives the uptime; without it ``uptime`` is ``null``.
    """
    rdzv = snapshot.rendezvous
    uptime = None if now_wall is None else max(0.0, now_wall - snapshot.started_at_wall)
    return {
        "run_id": snapshot.run_id,
        "version": __version__,
        "role": snapshot.role,
        "node_rank": rdzv.group_rank,
        "group_world_size": rdzv.group_world_size,
        "state": snapshot.phase,
        "status": snapshot.status_line,
        "attempt": snapshot.attempt,
        "restarts": {
            "used": snapshot.restart_count,
            "max": snapshot.max_restarts,
            "left": snapshot.restarts_left,
        },
        "world_size": snapshot.world_size,
        "local_world_size": snapshot.local_world_size,
        "workers": [_worker_json(w, progress, now_mono) for w in snapshot.workers],
        "last_failure": _failure_json(snapshot.last_failure),
        "rendezvous": _rendezvous_json(rdzv),
        "watchdog": {
            "enabled": snapshot.watchdog_enabled,
            "progress_timeout": snapshot.progress_timeout,
        },
        "exit_code": snapshot.exit_code,
        "started_at": snapshot.started_at_wall,
        "uptime": _round(uptime),
        "snapshot_age": _round(max(0.0, now_mono - snapshot.published_at)),
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
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
