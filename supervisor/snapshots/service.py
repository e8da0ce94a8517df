"""The supervisor's side of snapshots, put together: the slot table, the regions, the
socket, and the restore step decided at every launch.

A controller ``Observer``: when the state machine decides a launch (the last attempt's
workers are all stopped by then), the table decides the step the new attempt restores
(``core.slots``); over several nodes (etcd, c10d) the round decided it
(``core.jobstep``: this node reported ``report()`` when it joined) and the ranks this
node does not hold are read from ``--snapshot-dir``. Requests from the socket are
answered here: a reservation gets a slot (its region made or grown in a thread: reserving
pages of a large region takes tens of milliseconds), a commit makes a slot complete (and
is the rank's progress), a restore query gets the attempt's step.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
from anyio.abc import TaskStatus

from supervisor.config import ConfigError, Settings
from supervisor.core import state as sm
from supervisor.core.jobstep import DiskStep, Report, make_report
from supervisor.core.slots import (
    REPLICATED,
    Held,
    Refused,
    Restore,
    Slot,
    SlotTable,
    choose,
    slots_at,
    steps_held,
)
from supervisor.core.statusview import ProgressTable
from supervisor.errors import RendezvousError
from supervisor.rendezvous.etcd.wire.jobstep import PersistMark
from supervisor.snapshots.channel import (
    Commit,
    Identify,
    Request,
    Reserve,
    RestoreQuery,
    Sender,
    SnapshotChannel,
)
from supervisor.snapshots.memory import Regions
from supervisor.snapshots.persist import DirRefused, OnDisk, SnapshotDir, file_size, read_region

if TYPE_CHECKING:
    from supervisor.rendezvous.base import RendezvousResult
    from supervisor.rendezvous.etcd.persist_mark import PersistMarks

logger = logging.getLogger(__name__)

UNIX_PATH_MAX = 108  # sun_path, NUL included


@dataclass
class SnapshotCounts:
    """Saves kept and not kept, by reason (``/metrics``)."""

    kept: int = 0
    refused: int = 0
    no_room: int = 0
    over_limit: int = 0


class SnapshotService:
    """Owns this node's snapshot memory for the whole run."""

    def __init__(
        self,
        regions: Regions,
        socket_path: Path,
        identify: Identify,
        progress: ProgressTable,
        *,
        limit: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_restore: Callable[[Restore | None], None] = lambda restore: None,
        changed: Callable[[], None] = lambda: None,
        disk: SnapshotDir | None = None,
        persist_interval: float = 300.0,
        coordinated: bool = False,
        placement: Callable[[], RendezvousResult | None] = lambda: None,
        local_world_size: int = 1,
    ) -> None:
        self.regions = regions
        self.table = SlotTable()
        self.channel = SnapshotChannel(socket_path, identify, self.handle)
        self.progress = progress
        self.limit = limit
        self.clock = clock
        self.counts = SnapshotCounts()
        self.on_restore = on_restore
        self.changed = changed  # the read model's publish: memory or restore step changed
        self._warned: set[str] = set()
        self.disk = disk  # --snapshot-dir
        self.persist_interval = persist_interval
        self.persisted: int | None = None  # the newest step written to disk
        self.persist_failures = 0
        self._persisting = anyio.Lock()
        # the rendezvous decides the step job-wide (etcd, c10d): the round's result
        # carries it (``placement``: the round being launched), this node reports what it
        # holds when it joins (``report``)
        self.coordinated = coordinated
        self.placement = placement
        self.local_world_size = local_world_size
        self.disk_steps: list[DiskStep] = []  # complete in --snapshot-dir, as last read
        self._loaded: anyio.Event | None = None  # set once the attempt's step is in memory
        self._tg: anyio.abc.TaskGroup | None = None
        # --snapshot-dir over several nodes: group rank 0 names a step every interval
        # (``marks``), every node writes its part of it once it holds it (``_wanted``)
        self.marks: PersistMarks | None = None
        self._wanted: PersistMark | None = None
        self._written: set[tuple[int, int]] = set()  # (round, step): this node's part

    @property
    def socket_path(self) -> Path:
        return self.channel.path

    async def run(self, *, task_status: TaskStatus[Path]) -> None:
        """Read the newest step back from ``--snapshot-dir`` (memory is empty: the run
        starts), then serve the socket and persist every interval until cancelled; the
        regions go with it."""
        try:
            if self.disk is not None and not self.coordinated:
                await self._resume()
            await self._read_disk_steps()
            async with anyio.create_task_group() as tg:
                self._tg = tg
                path = await tg.start(self.channel.run)
                if self.disk is not None and self.coordinated:
                    if self.marks is not None:
                        tg.start_soon(self._mark_every, self.marks)
                        tg.start_soon(self._follow_marks, self.marks)
                elif self.disk is not None:
                    tg.start_soon(self._persist_every)
                task_status.started(path)
        finally:
            self.close()

    def close(self) -> None:
        self.regions.close()

    # ------------------------------------------------------------------ observer
    def on_transition(self, old: sm.State, new: sm.State, event: sm.Event,
                      decision: sm.Decision) -> None:
        if isinstance(decision, sm.LaunchGroup) and isinstance(event, sm.RendezvousComplete):
            self.decide(event.world_size)

    def on_launch(self, attempt: Any) -> None:
        return None

    def on_stopped(self, attempt: Any) -> None:
        return None

    def decide(self, world_size: int) -> Restore | None:
        """The step the attempt about to launch restores (its workers are not started):
        decided here on one node, by the round across nodes (``core.jobstep``)."""
        dropped = list(self.table.regions())
        restore = (self._settle(world_size) if self.coordinated
                   else self.table.decide(world_size))
        kept = {(s.key, s.index) for s in self.table.regions()}
        for slot in dropped:
            if (slot.key, slot.index) not in kept:
                self.regions.drop(slot)
        if restore is not None and restore.slots and self._loaded is None:
            self._restored(restore)
        self.changed()
        return restore

    def _restored(self, restore: Restore) -> None:
        logger.info("snapshots: this attempt restores step %d (%s, from %s)", restore.step,
                    "replicated" if restore.replicated else f"{len(restore.slots)} rank(s)",
                    restore.source)
        self.on_restore(restore)

    def _settle(self, world_size: int) -> Restore | None:
        """The round's step, for this node's ranks; those it does not hold are read from
        ``--snapshot-dir`` in the background (restore queries wait for them)."""
        result = self.placement()
        decided = result.snapshot if result is not None else None
        ranks = (range(result.rank_offset, result.rank_offset + self.local_world_size)
                 if result is not None else range(0))
        restore, missing = self.table.settle(
            world_size, decided.step if decided else None, ranks,
            decided.newest if decided else None)
        self._loaded = None
        if restore is not None and missing:
            assert self._tg is not None
            self._loaded = anyio.Event()
            self._tg.start_soon(self._load, restore.step, missing, self._loaded)
        return restore

    async def _load(self, step: int, missing: list[int], loaded: anyio.Event) -> None:
        """Read the ranks of ``step`` this node does not hold from ``--snapshot-dir``."""
        try:
            found = None
            if self.disk is not None:
                with contextlib.suppress(DirRefused):
                    found = await anyio.to_thread.run_sync(self.disk.at, step)
            if found is None:
                logger.warning("snapshots: step %d of rank(s) %s is neither in this node's "
                               "memory nor complete in --snapshot-dir: they start without it",
                               step, ", ".join(map(str, missing)))
                return
            keys = [REPLICATED] if found.marker.replicated else missing
            for key in keys:
                self.table.restore_adopted(await self._adopt(found, key))
        except OSError as exc:
            logger.warning("snapshot_dir: cannot read step %d back (%s): rank(s) %s start "
                           "without it", step, exc.strerror or exc,
                           ", ".join(map(str, missing)))
        finally:
            restore = self.table.restore
            if restore is not None and restore.slots:
                self._restored(restore)
            elif restore is not None:  # nothing to restore here after all: saves start over
                self.table.forget()
            loaded.set()
            self.changed()

    def report(self) -> Report:
        """What this node holds, told when it joins a round (``core.jobstep``): nothing
        is evicted until the round decides (the workers are stopped: no saves)."""
        held, replicated = self.table.held()
        return make_report(held, replicated, self.disk_steps)

    async def _read_disk_steps(self) -> None:
        """The complete steps of ``--snapshot-dir``, for the next report."""
        if self.disk is None:
            return
        try:
            found = await anyio.to_thread.run_sync(self.disk.complete)
        except (DirRefused, OSError):
            found = []
        self.disk_steps = [DiskStep(d.marker.step, d.marker.world_size, d.marker.replicated)
                           for d in found]

    # ------------------------------------------------------------------ requests
    async def handle(self, request: Request, sender: Sender) -> dict[str, Any]:
        match request:
            case Reserve():
                return await self._reserve(request)
            case Commit():
                return self._commit(request, sender)
            case RestoreQuery():
                if self._loaded is not None:
                    await self._loaded.wait()
                return self._restore(request)
        return {"ok": False, "reason": "unknown request"}

    async def _reserve(self, request: Reserve) -> dict[str, Any]:
        key = REPLICATED if request.replicated else request.rank
        previous = {s.index: s for s in self.table.slots.get(key, [])}
        result = self.table.reserve(key, request.step, request.size, self.limit)
        if isinstance(result, Held):
            return {"ok": True, "held": True}
        if isinstance(result, Refused):
            self._refused("over_limit" if "limit" in result.reason else "refused",
                          result.reason)
            return {"ok": False, "reason": result.reason}
        slot = result.slot
        if result.grow:
            old = previous.get(slot.index)
            try:
                await anyio.to_thread.run_sync(self.regions.make, slot, old)
            except OSError as exc:
                self.table.abandon(slot, old)
                kind = "no_room" if exc.errno in (errno.ENOSPC, errno.ENOMEM) else "refused"
                reason = (f"no room for {slot.capacity} bytes in {self.regions.directory.parent}"
                          if kind == "no_room" else f"cannot make a region: {exc.strerror}")
                self._refused(kind, reason)
                return {"ok": False, "reason": reason}
            self.changed()
        return {"ok": True, "slot": slot.index, "path": str(self.regions.path(slot)),
                "capacity": slot.capacity}

    def _commit(self, request: Commit, sender: Sender) -> dict[str, Any]:
        key = REPLICATED if request.replicated else request.rank
        done = self.table.commit(key, request.slot, request.step, request.size,
                                 request.checksum, self.clock())
        if not isinstance(done, Refused):
            if self._wanted is not None and self._wanted.step == request.step:
                assert self._tg is not None
                self._tg.start_soon(self._persist_wanted)
            self.counts.kept += 1
            self.progress.touch_save(sender.local_rank, self.clock())
            return {"ok": True}
        self._refused("refused", f"commit of step {request.step} in slot {request.slot} "
                      "matches no reservation")
        return {"ok": False, "reason": "no such reservation"}

    def _restore(self, request: RestoreQuery) -> dict[str, Any]:
        slot = self.table.restore_for(request.rank)
        if slot is None:
            return {"ok": True, "step": None}
        return {"ok": True, "step": slot.step, "path": str(self.regions.path(slot)),
                "size": slot.size, "checksum": slot.checksum}

    def _refused(self, kind: str, reason: str) -> None:
        setattr(self.counts, kind, getattr(self.counts, kind) + 1)
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning("a snapshot save was not kept: %s (further ones are counted)",
                           reason)

    # ------------------------------------------------------------------ the disk
    async def _resume(self) -> None:
        """Load the newest complete step of ``--snapshot-dir`` into regions."""
        assert self.disk is not None
        try:
            found = await anyio.to_thread.run_sync(self.disk.newest)
        except DirRefused as exc:
            logger.warning("snapshot_dir: not resumed from, not written: %s", exc)
            self.disk = None
            return
        if found is None:
            return
        marker = found.marker
        try:
            for key in marker.files:
                await self._adopt(found, key)
        except OSError as exc:
            logger.warning("snapshot_dir: cannot read step %d back (%s): starting without "
                           "it", marker.step, exc.strerror or exc)
            self._forget_adopted()
            return
        self.persisted = marker.step
        self.table.world_size = marker.world_size
        logger.info("snapshot_dir: step %d read back from %s", marker.step, found.directory)

    async def _adopt(self, found: OnDisk, key: int) -> Slot:
        path = found.path(key)
        size = await anyio.to_thread.run_sync(file_size, path)
        slot = self.table.adopt(key, found.marker.step, size, found.marker.world_size)
        await anyio.to_thread.run_sync(self.regions.make, slot, None)
        fd = os.open(self.regions.path(slot), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            checksum = await anyio.to_thread.run_sync(read_region, path, size, fd)
        finally:
            os.close(fd)
        if checksum < 0:
            raise OSError(errno.EINVAL, f"{path} is not a finished snapshot")
        return self.table.complete_adopted(slot, checksum)

    def _forget_adopted(self) -> None:
        for slot in list(self.table.regions()):
            self.regions.drop(slot)
        self.table.slots.clear()

    async def _persist_every(self) -> None:
        while True:
            await anyio.sleep(self.persist_interval)
            await self.persist()

    async def persist(self) -> int | None:
        """Write the newest step complete for every rank of this node, if newer than the
        last one written; returns the step written."""
        async with self._persisting:
            disk = self.disk
            restore = choose(self.table.complete(), self.table.world_size)
            if disk is None or restore is None or (
                    self.persisted is not None and restore.step <= self.persisted):
                return None
            for slot in restore.slots.values():
                self.table.set_persisting(slot.key, slot.index, True)
            try:
                await anyio.to_thread.run_sync(
                    disk.write, restore.step, restore.slots, self.regions.open_read,
                    self.table.world_size, restore.replicated, abandon_on_cancel=True)
            except DirRefused as exc:
                logger.warning("snapshot_dir: not written: %s", exc)
                self.disk = None
                return None
            except OSError as exc:
                self._persist_failed(restore.step, exc)
                return None
            finally:
                for slot in restore.slots.values():
                    self.table.set_persisting(slot.key, slot.index, False)
            self.persisted = restore.step
            logger.info("snapshot_dir: step %d written", restore.step)
            await self._read_disk_steps()
            return restore.step

    async def finish(self, timeout: float) -> None:
        """At the end of the job: persist the newest complete step, within ``timeout``
        (the previous complete step stays in DIR if time runs out). Over several nodes,
        which step each node's workers reached last may differ by one: each node writes
        its part of its two newest steps, the newest first; the newest one every node
        wrote becomes complete."""
        if self.disk is None:
            return
        with anyio.move_on_after(timeout):
            if not self.coordinated:
                await self.persist()
                return
            for step in self._held_steps()[:2]:
                await self._write_part(step)

    # ------------------------------------------------------- the disk, several nodes
    def _ranks(self) -> tuple[RendezvousResult, range] | None:
        result = self.placement()
        if result is None:
            return None
        return result, range(result.rank_offset, result.rank_offset + self.local_world_size)

    def _held_steps(self) -> list[int]:
        """Steps complete for every rank this node runs (or held replicated), newest
        first."""
        placed = self._ranks()
        if placed is None:
            return []
        return steps_held(self.table.complete(), placed[1], self.table.world_size)

    async def _mark_every(self, marks: PersistMarks) -> None:
        """Group rank 0: every interval, name the newest step it holds (the others write
        their parts of it as soon as they hold it too)."""
        while True:
            await anyio.sleep(self.persist_interval)
            placed, held = self._ranks(), self._held_steps()
            if placed is None or placed[0].group_rank != 0 or not held:
                continue
            if self.persisted is not None and held[0] <= self.persisted:
                continue
            try:
                await marks.put(held[0], placed[0].round)
            except RendezvousError as exc:
                logger.warning("snapshot_dir: cannot name step %d to persist: %s", held[0],
                               exc)

    async def _follow_marks(self, marks: PersistMarks) -> None:
        async for mark in marks.follow():
            placed = self._ranks()
            if placed is not None and mark.round == placed[0].round:
                self._wanted = mark
                await self._persist_wanted()

    async def _persist_wanted(self) -> None:
        """Write this node's part of the marked step once it holds it complete."""
        wanted, placed = self._wanted, self._ranks()
        if wanted is None or placed is None or wanted.round != placed[0].round:
            return
        if wanted.step in self._held_steps():
            self._wanted = None
            await self._write_part(wanted.step)

    async def _write_part(self, step: int) -> None:
        """Write this node's part of ``step`` (its ranks' files, or group rank 0 the
        replicated one), and the job-wide marker if every part is there."""
        placed = self._ranks()
        disk = self.disk
        if disk is None or placed is None:
            return
        result, ranks = placed
        slots = slots_at(self.table.complete(), step, ranks, self.table.world_size)
        if slots is None or (REPLICATED in slots and result.group_rank != 0) or (
                result.round, step) in self._written:
            return  # not held (evicted); replicated: group rank 0 writes the one copy
        async with self._persisting:
            for slot in slots.values():
                self.table.set_persisting(slot.key, slot.index, True)
            try:
                complete = await anyio.to_thread.run_sync(functools.partial(
                    disk.write, step, slots, self.regions.open_read, self.table.world_size,
                    REPLICATED in slots, group_rank=result.group_rank,
                    nodes=result.group_world_size), abandon_on_cancel=True)
            except DirRefused as exc:
                logger.warning("snapshot_dir: not written: %s", exc)
                self.disk = None
                return
            except OSError as exc:
                self._persist_failed(step, exc)
                return
            finally:
                for slot in slots.values():
                    self.table.set_persisting(slot.key, slot.index, False)
        self._written = {w for w in self._written if w[0] == result.round}
        self._written.add((result.round, step))
        logger.info("snapshot_dir: this node's part of step %d written%s", step,
                    " (the step is complete)" if complete else "")
        if complete:
            self.persisted = max(step, self.persisted or step)
        await self._read_disk_steps()

    def _persist_failed(self, step: int, exc: OSError) -> None:
        self.persist_failures += 1
        if "persist" not in self._warned:
            self._warned.add("persist")
            logger.warning("snapshot_dir: cannot write step %d (%s); training goes on, "
                           "memory keeps the snapshots (further failures are counted)",
                           step, exc.strerror or exc)

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        """What /status shows under ``snapshots``."""
        restore = self.table.restore
        return {
            "memory_bytes": self.table.memory(),
            "directory": str(self.regions.directory),
            "restored_step": restore.step if restore is not None else None,
            "restored_from": restore.source if restore is not None else None,
            "persisted_step": self.persisted,
            "persist_failures": self.persist_failures,
            "kept": self.counts.kept,
            "not_kept": {"refused": self.counts.refused, "no_room": self.counts.no_room,
                         "over_limit": self.counts.over_limit},
            "channel_refused": dict(self.channel.counts.by_kind),
        }


def open_snapshot_dir(settings: Settings, run_id: str) -> SnapshotDir | None:
    """``--snapshot-dir``, made if missing and checked to be this user's; a one-line
    ``ConfigError`` (exit 2) otherwise. A start-up check: before anything runs."""
    if not settings.snapshot_dir:
        return None
    disk = SnapshotDir(Path(settings.snapshot_dir), run_id,
                       any_run=settings.snapshot_resume_any)
    try:
        disk.check()
    except (OSError, DirRefused) as exc:
        raise ConfigError(f"snapshot_dir: {exc}") from None
    return disk


def build_snapshots(
    settings: Settings,
    *,
    coordinates_nodes: bool,
    runtime_dir: Path,
    progress: ProgressTable,
    identify: Identify,
    changed: Callable[[], None],
    on_restore: Callable[[Restore | None], None],
    placement: Callable[[], RendezvousResult | None] = lambda: None,
    disk: SnapshotDir | None = None,
) -> SnapshotService | None:
    """The node's snapshot service, or None (one warning) where snapshots cannot work:
    the static backend over several nodes (nothing agrees on a step across them), or no
    usable memory directory."""
    if not coordinates_nodes and settings.max_nodes > 1:
        logger.warning("snapshots: off (supervisor.snapshot.save returns False): the static "
                       "backend does not coordinate nodes, so nothing agrees on a step to "
                       "restore; use --rdzv-backend etcd or c10d")
        return None
    try:
        regions = Regions.create(Path(settings.snapshot_memory_dir))
    except OSError as exc:
        logger.warning("snapshots: off (supervisor.snapshot.save returns False): cannot make "
                       "a private directory in %s: %s", settings.snapshot_memory_dir,
                       exc.strerror)
        return None
    socket_path = runtime_dir / "snapshots.sock"
    if len(os.fsencode(socket_path)) >= UNIX_PATH_MAX:
        # a deep runtime directory: the regions' private directory (0700, ours, freed with
        # them) is short and just as private
        socket_path = regions.directory / "snapshots.sock"
    return SnapshotService(regions, socket_path, identify, progress,
                           limit=settings.snapshot_limit, changed=changed, disk=disk,
                           on_restore=on_restore, coordinated=coordinates_nodes,
                           placement=placement, local_world_size=settings.local_world_size,
                           persist_interval=settings.snapshot_persist_interval)
