"""Snapshot bytes without torch: a finished ``zipformat`` archive written into a region,
as the worker side lays a save out (records' data, then headers and checksum)."""

from __future__ import annotations

import mmap
import os
import zlib
from pathlib import Path

from supervisor.snapshots import zipformat


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
