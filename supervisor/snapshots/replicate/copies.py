"""One node's buddy copies put together: its server, its sender, one set of counters, and
what a new round changes.

The seam for the rendezvous integration (not built yet): start ``run`` beside the
snapshot service, call ``on_round`` with each round's members when the round forms (and
``wake`` when a save is committed); ``status`` and ``counts`` are for ``/status`` and
``/metrics``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import anyio
from anyio.abc import TaskStatus

from supervisor.core.buddies import BuddyPlan, plan
from supervisor.core.slots import SlotTable
from supervisor.snapshots.memory import Regions
from supervisor.snapshots.replicate.auth import Auth
from supervisor.snapshots.replicate.receive import BuddyReceiver
from supervisor.snapshots.replicate.send import Address, BuddySender
from supervisor.snapshots.replicate.wire import ReplicaCounts


class BuddyCopies:
    """This node's side of buddy copies, both directions."""

    def __init__(self, node: str, table: SlotTable, regions: Regions, auth: Auth, *,
                 host: str = "0.0.0.0", port: int = 0, rate: float | None = None,
                 limit: int | None = None) -> None:
        self.node = node
        self.counts = ReplicaCounts()
        self.receiver = BuddyReceiver(regions, auth, host=host, port=port, limit=limit,
                                      expected=frozenset(), counts=self.counts)
        self.sender = BuddySender(table, regions.open_read, auth, node, rate=rate,
                                  counts=self.counts)
        self.plan: BuddyPlan | None = None

    async def run(self, *, task_status: TaskStatus[int]) -> None:
        """Serve and send until cancelled; reports the port the server bound."""
        async with anyio.create_task_group() as tg:
            port: int = await tg.start(self.receiver.run)
            await tg.start(self.sender.run)
            task_status.started(port)

    def on_round(self, members: Sequence[str], addresses: Mapping[str, Address],
                 ranks: frozenset[int], world_size: int, restored: int | None) -> None:
        """A round formed: ``members`` in round order, their buddy servers' addresses,
        this node's global ranks, and the step the job restores (None: none). Copies of
        newer steps are another timeline's and go; copies of nodes that left stay (a
        member may fetch them) until ``forget``."""
        new = plan(members)
        self.receiver.trim(restored)
        ward = new.ward_of(self.node)
        self.receiver.expected = frozenset() if ward is None else frozenset({ward})
        buddy = new.buddy_of(self.node)
        # aimed again even at the same buddy: it says "held" if it keeps the step already
        self.sender.aim(None if buddy is None else addresses.get(buddy), ranks, world_size)
        self.plan = new

    def wake(self) -> None:
        """A save was committed: a newer step may be complete."""
        self.sender.wake()

    def forget(self, node: str) -> None:
        """``node``'s copy is no longer needed (its ranks are restored elsewhere)."""
        self.receiver.forget(node)

    def status(self) -> dict[str, Any]:
        plan_ = self.plan
        return {
            "buddy": None if plan_ is None else plan_.buddy_of(self.node),
            "ward": None if plan_ is None else plan_.ward_of(self.node),
            "sent": self.sender.status(),
            "kept": self.receiver.status(),
            "counts": self.counts.as_dict(),
        }
