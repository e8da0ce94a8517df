"""``/readyz``'s success body says the group runs, not "alive" (that is ``/healthz``'s)."""

from __future__ import annotations

from supervisor.core.health import liveness, ready_and_live
from supervisor.core.statusview import RendezvousView, StatusView, WorkerView

NOW = 1000.0


def running() -> StatusView:
    return StatusView(
        run_id="job", phase="running", attempt=0, restart_count=0, max_restarts=0,
        restarts_left=0, world_size=1, local_world_size=1, role="default",
        published_at=NOW, started_at_wall=0.0,
        workers=(WorkerView(local_rank=0, global_rank=0, pid=10, state="running",
                            started_at=1.0),),
        rendezvous=RendezvousView("static"), progress_timeout=60.0, ready_when="launched",
    )


def test_ready_says_running() -> None:
    verdict = ready_and_live(running(), {}, NOW, 0.0)
    assert verdict.as_json() == {"ok": True, "reason": "running"}


def test_live_still_says_alive() -> None:
    assert liveness(running(), {}, NOW, 0.0).reason == "alive (running)"


def test_ready_but_stuck_says_why() -> None:
    verdict = ready_and_live(running(), {0: NOW - 120.0}, NOW, 0.0)
    assert not verdict.ok and "made no progress" in verdict.reason
