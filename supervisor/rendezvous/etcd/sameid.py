"""Two jobs under one run id: what a node arriving at the etcd rendezvous can tell.

Every launch defaults to run id ``none`` (as torchrun's ``--rdzv-id``), so two jobs given
the same endpoint and no id meet as one: torchrun's agents would too. A node that arrives
(before it joins a round) and finds the job already closed, or recorded with another
``--nnodes``, has met another job: it says so in one line, with the fix. A different
``--nproc-per-node``, or a round that runs full without it, is said at once too, but only
as a warning (nodes of one job may run different numbers of workers; a node beyond the
maximum waits for room, and is only told so under the default run id: a job with an id
of its own starts its spares that way); if such a node then sees the job close without
it, the closing line says it met another job. Pure logic: the caller reads and writes etcd.

Key (under the job's ``ctl/``, not lease-bound, written once by the first node to arrive):
``ctl/shape {"nnodes": "MIN:MAX", "nproc_per_node": N}``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

FIX = "pass --rdzv-id with an id of this job's own (every node of a job the same)"


@dataclass(frozen=True)
class Meeting:
    """What to say on arrival: ``fatal`` lines end this node's rendezvous."""

    fatal: bool
    line: str


def shape_value(min_nodes: int, max_nodes: int, nproc_per_node: int) -> str:
    return json.dumps({"nnodes": f"{min_nodes}:{max_nodes}", "nproc_per_node": nproc_per_node})


def meet(run_id: str, *, closed: dict[str, Any] | None, shape: Any,
         running_sizes: Sequence[int] | None, min_nodes: int, max_nodes: int,
         nproc_per_node: int) -> Meeting | None:
    """The verdict for a node arriving at job ``run_id``: None when nothing is amiss.

    ``closed`` is ``ctl/closed``'s value, ``shape`` ``ctl/shape``'s (None if absent, any
    JSON: it is read from etcd), ``running_sizes`` the local world sizes of the round
    that runs now (None if none does)."""
    where = _where(run_id)
    if closed is not None:
        return Meeting(True, ended_line(run_id, closed))
    nnodes = f"{min_nodes}:{max_nodes}"
    theirs = shape.get("nnodes") if isinstance(shape, dict) else None
    if isinstance(theirs, str) and theirs != nnodes:
        return Meeting(True, f"{where} is in use by a job with --nnodes {theirs}, this node "
                             f"has --nnodes {nnodes}: it met another job under the same run "
                             f"id; {FIX}")
    sizes = set(running_sizes or ())
    if sizes and nproc_per_node not in sizes:
        listed = ", ".join(str(s) for s in sorted(sizes))
        return Meeting(False, f"{where}: the round running now has --nproc-per-node "
                              f"{listed}, this node {nproc_per_node}: if this is another job "
                              f"under the same run id, {FIX}")
    # a node beyond the maximum waits as a spare: meant so when the job has an id of its
    # own (healing's spares), a likely collision under the default id only
    if running_sizes is not None and len(running_sizes) >= max_nodes and run_id == "none":
        return Meeting(False, f"{where}: a round of {len(running_sizes)} node(s) (max "
                              f"{max_nodes}) runs without this node, which waits for room; if "
                              f"this is another job under the same run id, {FIX}")
    return None


def ended_line(run_id: str, closed: dict[str, Any]) -> str:
    """The job closed before this node ever took part in a round."""
    how = str(closed.get("reason") or ("job succeeded" if closed.get("ok") else "failed"))
    return (f"{_where(run_id)} belongs to a job that ended ({how}) without this node: it "
            f"met another job (or a finished run) under the same run id; {FIX}")


def _where(run_id: str) -> str:
    return f"run id {run_id!r}" + (" (the default)" if run_id == "none" else "")
