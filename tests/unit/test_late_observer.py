"""The controller's audience: an observer that attaches late (the metrics, after their
imports ran off the loop) hears every transition, launch and stop that came before it,
in order; with none coming, nothing is kept."""

from __future__ import annotations

from typing import Any

from supervisor.controller import Audience


class Recorder:
    def __init__(self) -> None:
        self.heard: list[tuple[str, Any]] = []

    def on_transition(self, old: Any, new: Any, event: Any, decision: Any) -> None:
        self.heard.append(("transition", event))

    def on_launch(self, attempt: Any) -> None:
        self.heard.append(("launch", attempt))

    def on_stopped(self, attempt: Any) -> None:
        self.heard.append(("stopped", attempt))


def test_a_late_observer_hears_launches_and_stops_as_well_as_transitions() -> None:
    early, late = Recorder(), Recorder()
    audience = Audience([early], late=True)
    audience.tell(lambda o: o.on_transition(None, None, "complete", None))
    audience.tell(lambda o: o.on_launch(0))  # attempt 0's warm starts, say
    audience.tell(lambda o: o.on_stopped(0))
    audience.tell(lambda o: o.on_launch(1))
    audience.attach_late(late)
    audience.tell(lambda o: o.on_stopped(1))
    expected = [("transition", "complete"), ("launch", 0), ("stopped", 0), ("launch", 1),
                ("stopped", 1)]
    assert early.heard == expected
    assert late.heard == expected


def test_without_a_late_observer_nothing_is_kept() -> None:
    audience = Audience([Recorder()], late=False)
    for attempt in range(1000):
        audience.tell(lambda o, a=attempt: o.on_launch(a))
    assert audience._heard is None
    late = Recorder()
    audience.attach_late(late)  # a caller that attaches anyway hears from now on
    audience.tell(lambda o: o.on_launch(1000))
    assert late.heard == [("launch", 1000)]
