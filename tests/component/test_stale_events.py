"""An earlier attempt's event is dropped by the read model's count, with one event-log
line each (``stale_event_dropped``), never silently."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from supervisor.config import Settings
from supervisor.controller import restart_policy
from supervisor.core import state as sm
from supervisor.events import EventLog
from supervisor.views import ReadModel
from supervisor.workers.group import WorkerGroup
from supervisor.workers.output import OutputPlan
from supervisor.workers.spawn import DeathSignal


def test_a_stale_event_is_counted_and_written_to_the_event_log(tmp_path: Path) -> None:
    settings = Settings(training_script="x.py")
    events = EventLog(tmp_path / "events.jsonl", "job")
    output = OutputPlan.from_settings(settings)
    group = WorkerGroup(
        settings, run_id="job", events=events, log_root=tmp_path / "logs", output=output,
        environ={"PYTHON_EXEC": sys.executable}, timer_file=None, post=lambda e: None,
        death=DeathSignal(),
    )
    view = ReadModel(settings, run_id="job", backend="static", group=group,
                     policy=restart_policy(settings), events=events, output=output,
                     timer_file=None, health_port=None)
    view.on_stale(sm.WorkerExited(1, 0, 10, 1, None, 1.0))
    view.on_stale(sm.DeadlineExpired(1, 0, 10, "step", 0.1, 1.0))
    events.close()
    lines = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    dropped = [x for x in lines if x["event"] == "stale_event_dropped"]
    assert [(x["dropped"], x["of_attempt"], x["count"]) for x in dropped] == [
        ("WorkerExited", 0, 1), ("DeadlineExpired", 0, 2)]
    assert view.stale_events == 2
