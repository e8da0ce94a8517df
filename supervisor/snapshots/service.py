"""The supervisor's side of snapshots, put together: the slot table, the regions, the
socket, and the restore step decided at every launch.

A controller ``Observer``: when the state machine decides a launch (the last attempt's
workers are all stopped by then), the table decides the step the new attempt restores
(``core.slots``). Requests from the socket are answered here: a reservation gets a slot
(its region made or grown in a thread: reserving pages of a large region takes tens of
milliseconds), a commit makes a slot complete (and is the rank's progress), a restore
query gets the attempt's step.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from anyio.abc import TaskStatus

from supervisor.config import ConfigError, Settings
from supervisor.core import state as sm
from supervisor.core.slots import REPLICATED, Held, Refused, Restore, SlotTable, choose
from supervisor.core.snapshot import ProgressTable
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
        nodes: Callable[[], int] = lambda: 1,
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
        self.nodes = nodes  # nodes in the round being launched

    @property
    def socket_path(self) -> Path:
        return self.channel.path

    async def run(self, *, task_status: TaskStatus[Path]) -> None:
        """Read the newest step back from ``--snapshot-dir`` (memory is empty: the run
        starts), then serve the socket and persist every interval until cancelled; the
        regions go with it."""
        try:
            if self.disk is not None:
                await self._resume()
            async with anyio.create_task_group() as tg:
                path = await tg.start(self.channel.run)
                if self.disk is not None:
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
        """The step the attempt about to launch restores (its workers are not started).

        Over several nodes nothing agrees on one step yet (the round's result does not
        carry it): every node restoring what it alone holds could restore different
        steps, so such an attempt restores nothing (one warning)."""
        dropped = list(self.table.regions())
        restore = self.table.decide(world_size)
        if restore is not None and self.nodes() > 1:
            if "nodes" not in self._warned:
                self._warned.add("nodes")
                logger.warning("snapshots: not restored: agreeing on one step across nodes "
                               "is not built yet; the attempt starts without a snapshot")
            self.table.forget()  # what this node held: another timeline from now on
            restore = None
        kept = {(s.key, s.index) for s in self.table.regions()}
        for slot in dropped:
            if (slot.key, slot.index) not in kept:
                self.regions.drop(slot)
        if restore is not None:
            logger.info("snapshots: this attempt restores step %d (%s)", restore.step,
                        "replicated" if restore.replicated else f"{len(restore.slots)} ranks")
        self.on_restore(restore)
        self.changed()
        return restore

    # ------------------------------------------------------------------ requests
    async def handle(self, request: Request, sender: Sender) -> dict[str, Any]:
        match request:
            case Reserve():
                return await self._reserve(request)
            case Commit():
                return self._commit(request, sender)
            case RestoreQuery():
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

    async def _adopt(self, found: OnDisk, key: int) -> None:
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
        self.table.complete_adopted(slot, checksum)

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
                self.persist_failures += 1
                if "persist" not in self._warned:
                    self._warned.add("persist")
                    logger.warning("snapshot_dir: cannot write step %d (%s); training goes "
                                   "on, memory keeps the snapshots (further failures are "
                                   "counted)", restore.step, exc.strerror or exc)
                return None
            finally:
                for slot in restore.slots.values():
                    self.table.set_persisting(slot.key, slot.index, False)
            self.persisted = restore.step
            logger.info("snapshot_dir: step %d written", restore.step)
            return restore.step

    async def finish(self, timeout: float) -> None:
        """At the end of the job: persist the newest complete step, within ``timeout``
        (the previous complete step stays in DIR if time runs out)."""
        if self.disk is None:
            return
        with anyio.move_on_after(timeout):
            await self.persist()

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
    nodes: Callable[[], int] = lambda: 1,
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
                           on_restore=on_restore, nodes=nodes,
                           persist_interval=settings.snapshot_persist_interval)
