"""The ``Controller`` with the null pool (no standbys), the static backend and real
worker interpreters, without the daemon around it: failures, restarts and the run's
result go through the controller alone, and every rank of every attempt starts cold.
What the controller hears from its tasks (a round formed, a failure's verdict) reaches
the state machine as events, in order; the event log's lines carry the attempt they
belong to."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio

from supervisor.config import Settings
from supervisor.controller import Controller, InboxItem, restart_policy
from supervisor.core import state as sm
from supervisor.core.statusview import ProgressTable
from supervisor.events import EventLog
from supervisor.healing import make_healing
from supervisor.rendezvous.registry import make_rendezvous
from supervisor.views import ReadModel, RunResult
from supervisor.workers.group import Attempt, WorkerGroup
from supervisor.workers.nodecheck import CheckLauncher
from supervisor.workers.output import OutputPlan
from supervisor.workers.spawn import DeathSignal, Start
from supervisor.workers.warm.base import NullPool
from tests.support.eventlog import read_events
from tests.support.paths import FAKE_WORKER


class Heard:
    """An observer that keeps each transition (event, phases, stop reason) and the round
    the controller and the read model hold when a ``RendezvousComplete`` is applied."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, str, str, str | None]] = []
        self.rounds: list[tuple[int, int | None, int | None]] = []
        self.controller: Controller | None = None

    def on_transition(self, old: sm.State, new: sm.State, event: sm.Event,
                      decision: sm.Decision) -> None:
        self.steps.append((type(event).__name__, old.phase.value, new.phase.value,
                           new.stop_reason.value if new.stop_reason else None))
        if isinstance(event, sm.RendezvousComplete):
            assert self.controller is not None
            held, shown = self.controller.round, self.controller.view.round
            self.rounds.append((event.round, held.round if held else None,
                                shown.round if shown else None))

    def on_launch(self, attempt: Attempt) -> None:
        return None

    def on_stopped(self, attempt: Attempt) -> None:
        return None


async def run_controller(tmp_path: Path, args: list[str], max_restarts: int,
                         heard: Heard | None = None, **more: Any
                         ) -> tuple[RunResult, Controller]:
    """One run of two fake ranks under a Controller wired as the daemon wires it, with a
    ``NullPool``; bounded, so a controller that never ends fails the test. ``more``:
    further settings (with ``max_node_failures``, healing as the daemon makes it)."""
    settings = Settings(training_script=FAKE_WORKER, training_script_args=args,
                        nproc_per_node="2", max_restarts=max_restarts, shutdown_timeout=5.0,
                        master_port=0, **more)
    events = EventLog(tmp_path / "events.jsonl", "job")
    output = OutputPlan.from_settings(settings)
    rendezvous = make_rendezvous(settings, "job", tmp_path)
    send, receive = anyio.create_memory_object_stream[InboxItem](max_buffer_size=4096)
    environ = {"PATH": "/usr/bin:/bin", "PYTHON_EXEC": sys.executable}
    group = WorkerGroup(
        settings, run_id="job", events=events, log_root=tmp_path / "logs", output=output,
        environ=environ, timer_file=None,
        post=send.send_nowait, death=DeathSignal(), pool=NullPool(), sweep_adopted=False,
    )
    policy = restart_policy(settings)
    view = ReadModel(settings, run_id="job", backend=rendezvous.backend, group=group,
                     policy=policy, events=events, output=output, timer_file=None,
                     health_port=None)
    healing = None
    if settings.max_node_failures:
        healing = make_healing(settings, rendezvous, events, environ, "job", tmp_path / "logs",
                               launcher=CheckLauncher(), changed=view.publish)
    controller = Controller(settings, rendezvous, group=group, view=view, policy=policy,
                            events=events, output=output, progress=ProgressTable(),
                            observers=[heard] if heard is not None else [],
                            healing=healing)
    if heard is not None:
        heard.controller = controller
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


async def test_a_round_reaches_the_controller_and_the_read_model_in_its_transition(
        tmp_path: Path) -> None:
    heard = Heard()
    result, _ = await run_controller(tmp_path, ["--exit", "3", "--fail-attempts", "1"],
                                     max_restarts=1, heard=heard)
    assert result.exit_code == 0
    # each round is the controller's and the read model's when its event is applied
    assert [(number, held, shown) for number, held, shown in heard.rounds] == [
        (number, number, number) for number, _, _ in heard.rounds]
    assert len(heard.rounds) == 2


async def test_a_failures_verdict_is_an_event_applied_before_the_group_stopped(
        tmp_path: Path) -> None:
    """Healing's verdict (here: quarantine, this node's first failure of one allowed)
    comes back from the stop's task as an event of its own, which the state machine
    applies in STOPPING before ``GroupStopped`` ends the stop."""
    heard = Heard()
    result, controller = await run_controller(
        tmp_path, ["--exit", "3", "--fail-rank", "1", "--hang"], max_restarts=3, heard=heard,
        max_node_failures=1)
    assert controller.state.phase is sm.Phase.QUARANTINED and result.exit_code == 200
    stopping = heard.steps[[s[0] for s in heard.steps].index("WorkerExited"):]
    verdict = [s for s in stopping if s[0] == "NodeQuarantined"]
    assert verdict == [("NodeQuarantined", "stopping", "stopping", "quarantine")]
    assert stopping[-1] == ("GroupStopped", "stopping", "quarantined", "quarantine")
    order = [e["event"] for e in read_events(tmp_path / "events.jsonl")
             if e["event"] in ("node_quarantined", "group_stopped")]
    assert order == ["node_quarantined", "group_stopped"]


async def test_every_event_log_line_carries_the_attempt_it_belongs_to(
        tmp_path: Path) -> None:
    await run_controller(tmp_path, ["--exit", "3", "--fail-attempts", "1"], max_restarts=1)
    lines = read_events(tmp_path / "events.jsonl")
    labels = [e["attempt"] for e in lines]
    assert labels == sorted(labels) and set(labels) == {0, 1}
    first_of_second = labels.index(1)
    # the second attempt's lines begin with its launch: the rendezvous before it is the
    # first attempt's stop and restart
    assert lines[first_of_second]["event"] == "group_started"
    running = [e["attempt"] for e in lines if e["event"] == "state" and e["new"] == "running"]
    assert running == [0, 1]
