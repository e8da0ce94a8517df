"""An earlier attempt's event is dropped by the read model's count, with one event-log
line each (``stale_event_dropped``), never silently; the count is shown where operators
look: ``stale_events`` in ``/status`` and a counter in ``/metrics``, both read from the
snapshot the read model publishes, so they always agree."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from supervisor.config import Settings
from supervisor.controller import restart_policy
from supervisor.core import health
from supervisor.core import state as sm
from supervisor.events import EventLog
from supervisor.health.metrics import Metrics
from supervisor.views import ReadModel
from supervisor.workers.group import WorkerGroup
from supervisor.workers.output import OutputPlan
from supervisor.workers.spawn import DeathSignal

COUNTER = "elastic_supervisor_stale_events_dropped_total"


def _view(tmp_path: Path) -> tuple[ReadModel, EventLog]:
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
    return view, events


def _counter(metrics: Metrics) -> float:
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name == COUNTER:
                return sample.value
    raise AssertionError(f"{COUNTER} not exported")


def test_a_stale_event_is_counted_and_written_to_the_event_log(tmp_path: Path) -> None:
    view, events = _view(tmp_path)
    view.on_stale(sm.WorkerExited(1, 0, 10, 1, None, 1.0))
    view.on_stale(sm.DeadlineExpired(1, 0, 10, "step", 0.1, 1.0))
    events.close()
    lines = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    dropped = [x for x in lines if x["event"] == "stale_event_dropped"]
    assert [(x["dropped"], x["of_attempt"], x["count"]) for x in dropped] == [
        ("WorkerExited", 0, 1), ("DeadlineExpired", 0, 2)]
    assert view.stale_events == 2


def test_status_and_metrics_show_the_stale_events_dropped(tmp_path: Path) -> None:
    view, events = _view(tmp_path)
    metrics = Metrics()
    now = time.monotonic()
    metrics.observe(view.hub.current, {}, now, 0.0)
    assert health.status_document(view.hub.current, {}, now)["stale_events"] == 0
    assert _counter(metrics) == 0  # exported from the start: alerts see the series
    view.on_stale(sm.WorkerExited(1, 0, 10, 1, None, 1.0))
    view.on_stale(sm.MembershipChanged("node lost", 1))
    events.close()
    snapshot = view.hub.current  # published by the drop itself, no transition needed
    assert health.status_document(snapshot, {}, now)["stale_events"] == 2
    metrics.observe(snapshot, {}, now, 0.0)
    assert _counter(metrics) == 2
