"""The ``Controller`` with the null pool (no standbys), the static backend and real
worker interpreters, without the daemon around it: failures, restarts and the run's
result go through the controller alone, and every rank of every attempt starts cold."""

from __future__ import annotations

import sys
from pathlib import Path

import anyio

from supervisor.config import Settings
from supervisor.controller import Controller, ForwardSignal, ReopenLogs, restart_policy
from supervisor.core import state as sm
from supervisor.core.snapshot import ProgressTable
from supervisor.events import EventLog
from supervisor.rendezvous.registry import make_rendezvous
from supervisor.views import ReadModel, RunResult
from supervisor.workers.group import WorkerGroup
from supervisor.workers.output import OutputPlan
from supervisor.workers.spawn import DeathSignal, Start
from supervisor.workers.warm.base import NullPool
from tests.support.eventlog import read_events
from tests.support.paths import FAKE_WORKER

Inbox = sm.Event | ForwardSignal | ReopenLogs


async def run_controller(tmp_path: Path, args: list[str], max_restarts: int
                         ) -> tuple[RunResult, Controller]:
    """One run of two fake ranks under a Controller wired as the daemon wires it, with a
    ``NullPool``; bounded, so a controller that never ends fails the test."""
    settings = Settings(training_script=FAKE_WORKER, training_script_args=args,
                        nproc_per_node="2", max_restarts=max_restarts, shutdown_timeout=5.0,
                        master_port=0)
    events = EventLog(tmp_path / "events.jsonl", "job")
    output = OutputPlan.from_settings(settings)
    rendezvous = make_rendezvous(settings, "job", tmp_path)
    send, receive = anyio.create_memory_object_stream[Inbox](max_buffer_size=4096)
    group = WorkerGroup(
        settings, run_id="job", events=events, log_root=tmp_path / "logs", output=output,
        environ={"PATH": "/usr/bin:/bin", "PYTHON_EXEC": sys.executable}, timer_file=None,
        post=send.send_nowait, death=DeathSignal(), pool=NullPool(), sweep_adopted=False,
    )
    policy = restart_policy(settings)
    view = ReadModel(settings, run_id="job", backend=rendezvous.backend, group=group,
                     policy=policy, events=events, output=output, timer_file=None,
                     health_port=None)
    controller = Controller(settings, rendezvous, group=group, view=view, policy=policy,
                            events=events, output=output, progress=ProgressTable())
    try:
        await rendezvous.connect()
        with anyio.fail_after(60):
            result = await controller.run(receive, send)
    finally:
        send.close()
        receive.close()
        await rendezvous.aclose()
        events.close()
    return result, controller


async def test_a_failed_attempt_is_restarted_cold_and_the_next_one_succeeds(
        tmp_path: Path) -> None:
    result, controller = await run_controller(
        tmp_path, ["--exit", "3", "--fail-attempts", "1"], max_restarts=1)
    assert (result.exit_code, result.attempt_started) == (0, True)
    assert controller.state.phase is sm.Phase.SUCCEEDED
    assert controller.state.restart_count == 1
    started = read_events(tmp_path / "events.jsonl", "group_started")
    assert [e["attempt"] for e in started] == [0, 1]
    attempt = controller.attempt
    assert attempt is not None and attempt.number == 2  # the second (numbers start at 1)
    assert [w.start for w in attempt.workers] == [Start(), Start()]  # cold, no reason


async def test_a_failure_with_no_restart_left_ends_the_run_with_its_exit_code(
        tmp_path: Path) -> None:
    result, controller = await run_controller(
        tmp_path, ["--exit", "3", "--fail-rank", "1", "--hang"], max_restarts=0)
    assert result.exit_code == 3 and controller.state.phase is sm.Phase.FAILED
    assert [(f.local_rank, f.exit_code) for f in result.failures] == [(1, 3)]
    assert "local rank 1" in result.root_cause, result
    assert len(read_events(tmp_path / "events.jsonl", "group_started")) == 1
