"""The job-wide restore step on the wire: a node's ``core.jobstep.Report`` in its join
value, the decision in the round's result. O(1) etcd writes per node per round: the
report rides on the join key a node writes anyway, the step on the result the closing
node writes anyway.

    nodes/N/join/<node>   {..., "snap": {"m": [[step, world, first, last], ...],
                                         "r": [step, ...], "d": [[step, world, 0|1], ...]}}
    ctl/result/N          {..., "snap": {"step": S|null, "newest": S|null}}

A join without ``snap`` comes from a node without snapshots: it holds nothing. A result
without ``snap``: no member reported (snapshots are off on every node).

    ctl/persist           {"step": S, "round": N}

The persist mark (``--snapshot-dir``): every ``--snapshot-persist-interval`` group rank 0
of round N names the step every node writes its part of; every agent's control watch
brings it (one write per interval for the whole job).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from supervisor.core.jobstep import (
    MAX_SPANS,
    MAX_STEPS,
    DiskStep,
    JobStep,
    Report,
    ReportSource,
    Span,
    decide,
)

_Step = Annotated[int, msgspec.Meta(ge=0, le=1 << 53)]
_World = Annotated[int, msgspec.Meta(ge=1, le=1 << 31)]
_Rank = Annotated[int, msgspec.Meta(ge=0, le=1 << 31)]
_Flag = Annotated[int, msgspec.Meta(ge=0, le=1)]



class WireReport(msgspec.Struct, frozen=True):
    """A join value's ``snap``: what the node holds (see ``core.jobstep.Report``)."""

    m: Annotated[list[tuple[_Step, _World, _Rank, _Rank]],
                 msgspec.Meta(max_length=MAX_SPANS)] = []
    r: Annotated[list[_Step], msgspec.Meta(max_length=MAX_STEPS)] = []
    d: Annotated[list[tuple[_Step, _World, _Flag]], msgspec.Meta(max_length=MAX_STEPS)] = []

    def __post_init__(self) -> None:
        if any(first > last or last >= world for _, world, first, last in self.m):
            raise ValueError("a span of ranks is empty or beyond its world size")

    def report(self) -> Report:
        return Report(tuple(Span(*span) for span in self.m), tuple(self.r),
                      tuple(DiskStep(step, world, bool(rep)) for step, world, rep in self.d))


class WireStep(msgspec.Struct, frozen=True):
    """A result's ``snap``: the round's ``core.jobstep.JobStep``."""

    step: _Step | None = None
    newest: _Step | None = None

    def job_step(self) -> JobStep:
        return JobStep(self.step, self.newest)


def report_value(report: Report) -> dict[str, Any]:
    """The join value's ``snap``."""
    return {"m": [[s.step, s.world_size, s.first, s.last] for s in report.memory],
            "r": list(report.replicated),
            "d": [[d.step, d.world_size, int(d.replicated)] for d in report.disk]}


def join_fields(source: ReportSource | None) -> dict[str, Any]:
    """The fields this node adds to its join value (none without snapshots)."""
    report = source() if source is not None else None
    return {} if report is None else {"snap": report_value(report)}


def result_fields(members: Sequence[tuple[int, WireReport | None]]) -> dict[str, Any]:
    """The fields the closing node adds to the round's result: the step decided over the
    members' reports (``(local_world_size, report)`` in group-rank order); none when no
    member reported."""
    if all(report is None for _, report in members):
        return {}
    step = decide([(size, report.report() if report is not None else None)
                   for size, report in members])
    return {"snap": {"step": step.step, "newest": step.newest}}


class PersistMark(msgspec.Struct, frozen=True):
    """``ctl/persist``: the step every node of round ``round`` persists."""

    step: _Step
    round: _Step

