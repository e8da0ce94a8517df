"""One restore step for the whole job, decided when a round closes: pure, no I/O.

When an attempt ends, every node stops its workers and then joins the restart's round
with a ``Report`` of what it holds: the steps complete in its memory (per global rank,
under the world size they were saved under), the steps of its replicated copy, and the
complete steps it can read in ``--snapshot-dir``. The node that closes the round runs
``decide`` over the members' reports, in group-rank order, and the round's result carries
the step: every rank of the new round restores it.

A node can give its ranks of the new round a step ``S`` when, for each of them, it holds
``S`` in memory (saved under the new world size: per-rank snapshots are that world's
shards), or holds ``S`` replicated (any world size), or reads ``S`` complete in
``--snapshot-dir`` (per-rank under the new world size, or replicated). A rank's snapshot
held only by another node does not count: nodes do not copy snapshots to each other (a
rank that moved to another node falls back to ``--snapshot-dir``). The step is the newest
one that every member can give; none: the job starts from scratch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import msgspec

MAX_SPANS = 32  # memory spans a report keeps (the newest steps first)
MAX_STEPS = 8  # replicated and on-disk steps a report keeps


class JobStep(msgspec.Struct, frozen=True):
    """A round's decision: the step every rank restores (None: none), and the newest step
    any member held in memory (for goodput's steps redone)."""

    step: int | None = None
    newest: int | None = None


@dataclass(frozen=True)
class Span:
    """Step ``step`` complete in memory for global ranks ``first..last``, saved under
    ``world_size``."""

    step: int
    world_size: int
    first: int
    last: int


@dataclass(frozen=True)
class DiskStep:
    """A step complete in ``--snapshot-dir`` (its job-wide marker is there)."""

    step: int
    world_size: int
    replicated: bool


@dataclass(frozen=True)
class Report:
    """What one node holds when it joins a round."""

    memory: tuple[Span, ...] = ()
    replicated: tuple[int, ...] = ()
    disk: tuple[DiskStep, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.memory or self.replicated or self.disk)



ReportSource = Callable[[], "Report | None"]  # what a node holds now (None: no snapshots)

def spans(held: Iterable[tuple[int, int, int]]) -> tuple[Span, ...]:
    """``(step, world_size, rank)`` triples as spans of consecutive ranks, the newest
    steps first, at most ``MAX_SPANS`` (a report that leaves some out only makes the
    decision more cautious)."""
    found: list[Span] = []
    for step, world, rank in sorted(set(held), key=lambda t: (-t[0], t[1], t[2])):
        last = found[-1] if found else None
        if last is not None and (last.step, last.world_size) == (step, world) \
                and last.last + 1 == rank:
            found[-1] = Span(step, world, last.first, rank)
        else:
            found.append(Span(step, world, rank, rank))
    return tuple(found[:MAX_SPANS])


def make_report(held: Iterable[tuple[int, int, int]], replicated: Iterable[int],
                disk: Iterable[DiskStep]) -> Report:
    return Report(spans(held), tuple(sorted(set(replicated), reverse=True))[:MAX_STEPS],
                  tuple(sorted(set(disk), key=lambda d: -d.step))[:MAX_STEPS])


def gives(report: Report, step: int, world_size: int, first: int, count: int) -> bool:
    """Whether a node with ``report`` can give global ranks ``first..first+count-1`` of a
    world of ``world_size`` the state of ``step``."""
    if step in report.replicated:
        return True
    if any(d.step == step and (d.replicated or d.world_size == world_size)
           for d in report.disk):
        return True
    held = [s for s in report.memory if s.step == step and s.world_size == world_size]
    return all(any(s.first <= rank <= s.last for s in held)
               for rank in range(first, first + count))


def decide(members: Sequence[tuple[int, Report | None]]) -> JobStep:
    """The step of a round whose ``members`` are ``(local_world_size, report)`` in
    group-rank order (a member without a report holds nothing)."""
    reports = [r if r is not None else Report() for _, r in members]
    world_size = sum(size for size, _ in members)
    in_memory = {s.step for r in reports for s in r.memory} | {
        step for r in reports for step in r.replicated}
    newest = max(in_memory, default=None)
    candidates = in_memory | {d.step for r in reports for d in r.disk}
    for step in sorted(candidates, reverse=True):
        offset, ok = 0, True
        for (size, _), report in zip(members, reports, strict=True):
            if not gives(report, step, world_size, offset, size):
                ok = False
                break
            offset += size
        if ok and members:
            return JobStep(step, newest)
    return JobStep(None, newest)
