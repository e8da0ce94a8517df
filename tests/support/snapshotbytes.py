"""Snapshot bytes without torch: a finished ``zipformat`` archive written into a region,
as the worker side lays a save out (records' data, then headers and checksum)."""

from __future__ import annotations

import hashlib
import mmap
import os
import zlib
from pathlib import Path

from supervisor.core.slots import Refused, Reserved, SlotTable
from supervisor.snapshots import zipformat
from supervisor.snapshots.memory import Regions


def write_snapshot(path: Path, payloads: dict[str, bytes]) -> tuple[int, int]:
    """Lay ``payloads`` (record name -> data) out in the existing region file at ``path``
    (large enough); returns the snapshot's size and its checksum."""
    layout = zipformat.plan([(name, len(data)) for name, data in payloads.items()])
    fd = os.open(path, os.O_RDWR)
    try:
        with mmap.mmap(fd, layout.size) as mapped:
            view = memoryview(mapped)
            for record, data in zip(layout.records, payloads.values(), strict=True):
                view[record.data:record.data + record.size] = data
            checksum = zipformat.finish(view, layout, [zlib.crc32(d)
                                                       for d in payloads.values()])
            view.release()
    finally:
        os.close(fd)
    return layout.size, checksum


def snapshot_size(payloads: dict[str, bytes]) -> int:
    return zipformat.plan([(name, len(data)) for name, data in payloads.items()]).size


def payload(rank: int, step: int, nbytes: int) -> bytes:
    """Bytes that differ per rank and step (so a mix-up shows)."""
    seed = hashlib.sha256(f"{rank}/{step}".encode()).digest()
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


def save_step(table: SlotTable, regions: Regions, rank: int, step: int,
              nbytes: int = 1 << 20) -> None:
    """A worker's save of ``step`` for ``rank``, as the snapshot socket sees it: reserve
    a slot (a region made or grown), lay the snapshot out in it, commit its checksum."""
    payloads = {"data.pkl": f"rank {rank} step {step}".encode(),
                "data/0": payload(rank, step, nbytes)}
    previous = {s.index: s for s in table.slots.get(rank, [])}
    reserved = table.reserve(rank, step, snapshot_size(payloads))
    assert isinstance(reserved, Reserved), reserved
    if reserved.grow:
        regions.make(reserved.slot, previous.get(reserved.slot.index))
    size, checksum = write_snapshot(regions.path(reserved.slot), payloads)
    done = table.commit(rank, reserved.slot.index, step, size, checksum, 0.0)
    assert not isinstance(done, Refused), done
