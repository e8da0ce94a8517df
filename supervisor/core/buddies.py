"""Buddy copies: which node keeps a copy of which node's snapshots, what a buddy accepts,
and how fast a copy may be sent.

Pure logic for ``supervisor.snapshots.replicate``: no I/O, no clock (times arrive in the
calls). A round's members, in round order, form a ring: each node sends the newest step
complete for all of its ranks to the next one, so every node's state has exactly one copy
elsewhere and every node keeps exactly one other node's copy. A round of one node has no
buddy. The plan is a function of the members alone: a round whose membership (or order)
changed gets a new plan, and every node computes the same one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from supervisor.core.slots import REPLICATED, Slot


class BadMembers(ValueError):
    """A round's members that cannot form a ring (an empty id or one given twice)."""


@dataclass(frozen=True)
class BuddyPlan:
    """The ring of one round: node -> the node that keeps its copy."""

    members: tuple[str, ...]

    def buddy_of(self, node: str) -> str | None:
        """The node ``node`` sends its copy to (None: a round of one, or not a member)."""
        if node not in self.members or len(self.members) < 2:
            return None
        return self.members[(self.members.index(node) + 1) % len(self.members)]

    def ward_of(self, node: str) -> str | None:
        """The node whose copy ``node`` keeps (None: a round of one, or not a member)."""
        if node not in self.members or len(self.members) < 2:
            return None
        return self.members[self.members.index(node) - 1]

    def pairs(self) -> dict[str, str]:
        """Every member's buddy."""
        return {node: buddy for node in self.members
                if (buddy := self.buddy_of(node)) is not None}


def plan(members: Sequence[str]) -> BuddyPlan:
    """The ring of the round whose members are ``members`` (node ids, in round order)."""
    if any(not node for node in members):
        raise BadMembers("a member without a node id")
    if len(set(members)) != len(members):
        raise BadMembers(f"a node id given twice in {list(members)}")
    return BuddyPlan(tuple(members))


def replanned(old: BuddyPlan | None, new: BuddyPlan, node: str) -> bool:
    """Whether ``node``'s buddy or ward differ between two rounds (a new copy is due)."""
    if old is None:
        return new.buddy_of(node) is not None or new.ward_of(node) is not None
    return (old.buddy_of(node), old.ward_of(node)) != (new.buddy_of(node), new.ward_of(node))


# ---------------------------------------------------------------------------- sending
@dataclass(frozen=True)
class Outgoing:
    """The step a node sends: its slots holding it, one per global rank of the node."""

    step: int
    world_size: int
    slots: dict[int, Slot]  # global rank -> its slot holding ``step``


def newest_local(complete: Iterable[Slot], ranks: Iterable[int],
                 world_size: int) -> Outgoing | None:
    """The newest step complete for every one of this node's global ``ranks`` (saved under
    ``world_size``). A node's replicated copy is never sent: every node holds one."""
    wanted = frozenset(ranks)
    if not wanted:
        return None
    by_step: dict[int, dict[int, Slot]] = {}
    for slot in complete:
        if (slot.key != REPLICATED and slot.key in wanted and slot.step is not None
                and slot.world_size == world_size):
            by_step.setdefault(slot.step, {})[slot.key] = slot
    for step in sorted(by_step, reverse=True):
        if set(by_step[step]) == wanted:
            return Outgoing(step, world_size, by_step[step])
    return None


# ---------------------------------------------------------------------------- receiving
@dataclass(frozen=True)
class Offer:
    """What a sender proposes: ``node``'s ranks at ``step``, with sizes and checksums."""

    node: str
    step: int
    world_size: int
    sizes: Mapping[int, int]  # global rank -> bytes
    checksums: Mapping[int, int]  # global rank -> the save's checksum


def admit(offer: Offer, held_step: int | None, *, limit: int | None,
          expected: frozenset[str] | None, max_ranks: int) -> str | None:
    """Why a buddy refuses ``offer`` (None: it is taken, room permitting).

    ``held_step``: the step this node already keeps for ``offer.node``; ``limit``: the
    largest snapshot a rank may keep (``--snapshot-memory-limit``); ``expected``: the
    nodes whose copy this node is to keep (None: any member of the job)."""
    if expected is not None and offer.node not in expected:
        return f"this node keeps no copy for node {offer.node!r}"
    if not offer.sizes or len(offer.sizes) > max_ranks:
        return f"{len(offer.sizes)} ranks: expected 1 to {max_ranks}"
    if set(offer.sizes) != set(offer.checksums):
        return "every rank needs a size and a checksum"
    if any(rank < 0 or rank >= offer.world_size for rank in offer.sizes):
        return f"a rank outside the world of {offer.world_size}"
    if any(size <= 0 for size in offer.sizes.values()):
        return "a rank of no bytes"
    if held_step is not None and offer.step <= held_step:
        return f"step {offer.step} is not newer than the copy kept (step {held_step})"
    if limit is not None and (big := max(offer.sizes.values())) > limit:
        return (f"a rank's snapshot ({big} bytes) is above --snapshot-memory-limit "
                f"({limit} bytes)")
    return None


# ---------------------------------------------------------------------------- pacing
@dataclass
class Pace:
    """A token bucket bounding a transfer to ``rate`` bytes per second (None: unbounded).

    ``delay(n, now)`` says how long to wait before sending ``n`` more bytes; the bucket
    holds at most a second of credit, so a pause never turns into a burst above the rate
    for longer than that."""

    rate: float | None
    credit: float = 0.0
    last: float | None = None

    def delay(self, nbytes: int, now: float) -> float:
        if self.rate is None:
            return 0.0
        if self.last is not None:
            self.credit = min(self.rate, self.credit + (now - self.last) * self.rate)
        self.last = now
        self.credit -= nbytes
        return 0.0 if self.credit >= 0 else -self.credit / self.rate
