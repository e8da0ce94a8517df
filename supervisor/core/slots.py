"""Which snapshot slots hold what, which one a save may write, and the step to restore.

Pure bookkeeping for ``supervisor.snapshots``: no I/O, no clock (times arrive in the
calls). A *key* is whose snapshot it is: a global rank, or ``REPLICATED`` for the node's
one copy of a state every rank holds. Each key has at most ``MAX_SLOTS`` slots (regions of
shared memory): the two newest complete steps and one being written. A save reserves a
slot for its step, copies into it, then commits it; a slot becomes complete only when the
worker commits it (completion is told, never guessed). Slots are pinned while a restore
may need them (the attempt's step) or while they are being persisted.

The restore step is decided once per attempt, after the previous attempt's workers are
stopped: the newest step complete for every global rank of the new world (or held once
for the node, replicated). Nothing is evicted before that decision; after it, snapshots
newer than the chosen step (another timeline: a rank that got further than a peer) are
dropped, and no save of the attempt may evict the chosen step.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

MAX_SLOTS = 3
REPLICATED = -1  # the key of a node's replicated snapshot
GRAIN = 1 << 20  # region sizes are whole MiB


class SlotState(enum.Enum):
    FREE = "free"  # its region holds nothing of use (never written, torn, or evicted)
    WRITING = "writing"  # reserved for a step, not committed yet
    COMPLETE = "complete"


@dataclass(frozen=True)
class Slot:
    """One region of shared memory of a key."""

    key: int
    index: int
    generation: int  # a new region (a bigger one) gets a new generation, a new name
    capacity: int  # bytes
    state: SlotState = SlotState.FREE
    step: int | None = None
    size: int = 0  # bytes of the snapshot in it
    checksum: int | None = None
    world_size: int = 0  # of the attempt that saved it (per-rank shards fit only it)
    saved_at: float = 0.0  # monotonic time of the commit
    persisting: bool = False
    from_disk: bool = False  # read back from --snapshot-dir, not saved in this run

    @property
    def name(self) -> str:
        owner = "node" if self.key == REPLICATED else f"rank{self.key}"
        return f"{owner}-slot{self.index}-gen{self.generation}"


@dataclass(frozen=True)
class Reserved:
    """Write ``slot`` (grown first when ``grow`` is set: a new region of its capacity)."""

    slot: Slot
    grow: bool


@dataclass(frozen=True)
class Held:
    """Replicated: this step (or a newer one) is already held or being written."""


@dataclass(frozen=True)
class Refused:
    reason: str


@dataclass(frozen=True)
class Restore:
    """The step every rank restores in an attempt, and the slots holding it."""

    step: int
    slots: dict[int, Slot]  # key -> its slot holding ``step``
    replicated: bool
    newest: int | None = None  # the newest step any rank had saved when it was chosen

    @property
    def saved_at(self) -> float | None:
        """When the step was complete on every rank (monotonic; None: read from disk)."""
        if any(s.from_disk for s in self.slots.values()):
            return None
        return max(s.saved_at for s in self.slots.values())

    @property
    def source(self) -> str:
        """Where the state comes from: "memory", or "disk" (``--snapshot-dir``)."""
        return "disk" if any(s.from_disk for s in self.slots.values()) else "memory"


def region_size(size: int) -> int:
    """The capacity of a region for a snapshot of ``size`` bytes: whole MiB (a pickle a
    few bytes longer at the next step needs no new region), no more, so that a rank's
    three regions stay within three times its state and a MiB each."""
    return max(GRAIN, (size + GRAIN - 1) // GRAIN * GRAIN)


@dataclass
class SlotTable:
    """Every key's slots on this node, the attempt's restore step and each key's floor."""

    slots: dict[int, list[Slot]] = field(default_factory=dict)
    restore: Restore | None = None
    floor: dict[int, int] = field(default_factory=dict)  # last step reserved per key
    world_size: int = 0
    # (key, index) -> readers of that slot's region (a buddy copy being sent): a save
    # never writes a slot being read
    readers: dict[tuple[int, int], int] = field(default_factory=dict)

    # ------------------------------------------------------------------ saves
    def reserve(self, key: int, step: int, size: int, limit: int | None = None
                ) -> Reserved | Held | Refused:
        """Choose the slot a save of ``step`` (``size`` bytes) writes."""
        written = self.floor.get(key)
        if key == REPLICATED and written is not None and step <= written:
            return Held()
        last = self._floor(key)
        if last is not None and step <= last:
            return Refused(f"step {step} is not above this rank's last step {last}")
        if limit is not None and size > limit:
            return Refused(f"the state ({size} bytes) is above --snapshot-memory-limit "
                           f"({limit} bytes)")
        slot = self._free_slot(key)
        if slot is None:
            return Refused("every snapshot slot is pinned (restore or persistence)")
        grow = slot.capacity < size
        capacity = region_size(size) if grow else slot.capacity
        taken = replace(slot, state=SlotState.WRITING, step=step, size=0, checksum=None,
                        capacity=capacity, generation=slot.generation + grow)
        self._put(taken)
        self.floor[key] = step
        return Reserved(taken, grow)

    def _floor(self, key: int) -> int | None:
        restored = self.restore.step if self.restore is not None else None
        candidates = [s for s in (self.floor.get(key), restored) if s is not None]
        return max(candidates) if candidates else None

    def _free_slot(self, key: int) -> Slot | None:
        """A slot to write: a new one while fewer than MAX_SLOTS, else the oldest one that
        is neither pinned nor among the two newest complete; else the second newest."""
        slots = self.slots.setdefault(key, [])
        for slot in slots:
            if slot.state is not SlotState.COMPLETE and not self._pinned(slot):
                return slot
        if len(slots) < MAX_SLOTS:
            slot = Slot(key, len(slots), 0, 0)
            slots.append(slot)
            return slot
        complete = sorted((s for s in slots if s.state is SlotState.COMPLETE),
                          key=lambda s: s.step or 0)
        newest_two = {s.index for s in complete[-2:]}
        for group in ([s for s in complete if s.index not in newest_two], complete[:-1]):
            for slot in group:
                if not self._pinned(slot):
                    return slot
        return None

    def _pinned(self, slot: Slot) -> bool:
        if slot.persisting or self.readers.get((slot.key, slot.index)):
            return True
        held = self.restore.slots.get(slot.key) if self.restore is not None else None
        return held is not None and held.index == slot.index

    def adopt(self, key: int, step: int, size: int, world_size: int) -> Slot:
        """A slot for a step read back from disk (a run that starts with nothing in
        memory); ``complete`` makes it count once its bytes are in its region."""
        slots = self.slots.setdefault(key, [])
        slot = Slot(key, len(slots), 1, region_size(size), SlotState.WRITING, step, size,
                    world_size=world_size, from_disk=True)
        slots.append(slot)
        return slot

    def complete_adopted(self, slot: Slot, checksum: int) -> Slot:
        done = replace(slot, state=SlotState.COMPLETE, checksum=checksum)
        self._put(done)
        return done

    def abandon(self, slot: Slot, previous: Slot | None) -> None:
        """A reservation whose region could not be made: the slot is as it was (a slot
        that did not exist keeps no region)."""
        self._put(previous if previous is not None
                  else replace(slot, state=SlotState.FREE, step=None, capacity=0))

    def commit(self, key: int, index: int, step: int, size: int, checksum: int,
               now: float) -> Slot | Refused:
        """The worker says the save of ``step`` into slot ``index`` is complete."""
        slot = self._slot(key, index)
        if slot is None or slot.state is not SlotState.WRITING or slot.step != step:
            return Refused(f"slot {index} was not reserved for step {step}")
        if not 0 < size <= slot.capacity:
            return Refused(f"size {size} does not fit slot {index}")
        done = replace(slot, state=SlotState.COMPLETE, size=size, checksum=checksum,
                       world_size=self.world_size, saved_at=now)
        self._put(done)
        return done

    def _slot(self, key: int, index: int) -> Slot | None:
        slots = self.slots.get(key, [])
        return slots[index] if 0 <= index < len(slots) else None

    def _put(self, slot: Slot) -> None:
        self.slots[slot.key][slot.index] = slot

    def set_persisting(self, key: int, index: int, persisting: bool) -> None:
        slot = self._slot(key, index)
        if slot is not None:
            self._put(replace(slot, persisting=persisting))

    def add_reader(self, slot: Slot) -> None:
        """Pin ``slot`` while its region is read (a buddy copy); one ``drop_reader`` each."""
        where = (slot.key, slot.index)
        self.readers[where] = self.readers.get(where, 0) + 1

    def drop_reader(self, slot: Slot) -> None:
        where = (slot.key, slot.index)
        left = self.readers.get(where, 0) - 1
        if left > 0:
            self.readers[where] = left
        else:
            self.readers.pop(where, None)

    # ------------------------------------------------------------------ restarts
    def _new_attempt(self, world_size: int) -> None:
        """Drop the saves left unfinished; the new attempt's world size, no floors yet."""
        for slots in self.slots.values():
            for slot in slots:
                if slot.state is SlotState.WRITING:
                    self._put(replace(slot, state=SlotState.FREE, step=None))
        self.world_size = world_size
        self.floor = {}

    def decide(self, world_size: int) -> Restore | None:
        """At the launch of an attempt (the last one's workers are all stopped): the step
        it restores. Saves left unfinished are dropped, then every snapshot newer than
        that step (or all, when there is none): the attempt's saves start a new timeline
        that must never be mixed with the old one's steps."""
        self._new_attempt(world_size)
        newest = max((s.step for s in self.complete() if s.step is not None), default=None)
        restore = choose(self.complete(), world_size)
        self.restore = None if restore is None else replace(restore, newest=newest)
        chosen = self.restore.step if self.restore is not None else None
        for slot in self.complete():
            if chosen is None or (slot.step or 0) > chosen:  # another timeline's
                self._put(replace(slot, state=SlotState.FREE, step=None))
        return self.restore

    def settle(self, world_size: int, step: int | None, ranks: range, newest: int | None
               ) -> tuple[Restore | None, list[int]]:
        """At the launch of an attempt of a job over several nodes: restore ``step``, the
        one the round decided for every rank (``core.jobstep``), for this node's global
        ``ranks``. Returns the restore with the slots this node holds, and the keys it
        must read from ``--snapshot-dir`` (``REPLICATED``, or ranks it does not hold).
        As ``decide``, unfinished saves and snapshots newer than the step are dropped;
        so are those of ranks this node no longer runs (nothing would ever read them)."""
        self._new_attempt(world_size)
        if step is None:
            self.forget()
            return None, []
        at = {s.key: s for s in self.complete() if s.step == step
              and (s.key == REPLICATED or s.world_size == world_size)}
        if REPLICATED in at:
            held, missing = {REPLICATED: at[REPLICATED]}, []
        else:
            held = {rank: at[rank] for rank in ranks if rank in at}
            missing = [rank for rank in ranks if rank not in at]
        self.restore = Restore(step, held, replicated=REPLICATED in held, newest=newest)
        for key in [k for k in self.slots if k != REPLICATED and k not in ranks]:
            del self.slots[key]
        for slot in self.complete():
            if (slot.step or 0) > step:  # another timeline's
                self._put(replace(slot, state=SlotState.FREE, step=None))
        return self.restore, missing

    def restore_adopted(self, slot: Slot) -> None:
        """A slot of the attempt's step read back from disk joins its restore."""
        if self.restore is not None and slot.step == self.restore.step:
            self.restore = replace(self.restore, slots={**self.restore.slots, slot.key: slot},
                                   replicated=slot.key == REPLICATED)

    def held(self) -> tuple[list[tuple[int, int, int]], list[int]]:
        """What this node holds complete: ``(step, world_size, rank)`` of per-rank
        snapshots, and the steps of its replicated copy (``core.jobstep.Report``)."""
        complete = [s for s in self.complete() if s.step is not None]
        return ([(s.step, s.world_size, s.key) for s in complete
                 if s.key != REPLICATED and s.world_size > 0 and s.step is not None],
                [s.step for s in complete if s.key == REPLICATED and s.step is not None])

    def forget(self) -> None:
        """No restore after all: every complete snapshot is dropped (the attempt starts a
        new timeline)."""
        self.restore = None
        for slot in self.complete():
            self._put(replace(slot, state=SlotState.FREE, step=None))

    def complete(self) -> list[Slot]:
        return [s for slots in self.slots.values() for s in slots
                if s.state is SlotState.COMPLETE]

    def restore_for(self, rank: int) -> Slot | None:
        """The slot ``rank`` restores from in this attempt (the node's, if replicated)."""
        if self.restore is None:
            return None
        key = REPLICATED if self.restore.replicated else rank
        return self.restore.slots.get(key)

    def regions(self) -> Iterable[Slot]:
        """Every slot that has a region (capacity > 0)."""
        return [s for slots in self.slots.values() for s in slots if s.capacity]

    def memory(self) -> int:
        """Bytes of shared memory reserved on this node."""
        return sum(s.capacity for s in self.regions())


def choose(complete: Iterable[Slot], world_size: int) -> Restore | None:
    """The newest step complete for every global rank ``0..world_size-1`` (saved under
    the same world size), or held once for the node (replicated: any world size)."""
    by_step: dict[int, dict[int, Slot]] = {}
    for slot in complete:
        if slot.step is not None and (slot.key == REPLICATED or slot.world_size == world_size):
            by_step.setdefault(slot.step, {})[slot.key] = slot
    for step in sorted(by_step, reverse=True):
        held = by_step[step]
        if REPLICATED in held:
            return Restore(step, {REPLICATED: held[REPLICATED]}, replicated=True)
        if world_size > 0 and all(rank in held for rank in range(world_size)):
            return Restore(step, {rank: held[rank] for rank in range(world_size)},
                           replicated=False)
    return None


def slots_at(complete: Iterable[Slot], step: int, ranks: range, world_size: int
             ) -> dict[int, Slot] | None:
    """The slots holding ``step`` for every one of ``ranks`` (saved under
    ``world_size``), or the replicated one; None if some rank lacks it."""
    at = {s.key: s for s in complete if s.step == step
          and (s.key == REPLICATED or s.world_size == world_size)}
    if REPLICATED in at:
        return {REPLICATED: at[REPLICATED]}
    if len(ranks) and all(rank in at for rank in ranks):
        return {rank: at[rank] for rank in ranks}
    return None


def steps_held(complete: Iterable[Slot], ranks: range, world_size: int) -> list[int]:
    """The steps ``slots_at`` finds, newest first."""
    slots = list(complete)
    steps = {s.step for s in slots if s.step is not None}
    return sorted((step for step in steps
                   if slots_at(slots, step, ranks, world_size) is not None), reverse=True)
