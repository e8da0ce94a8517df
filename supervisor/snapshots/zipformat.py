"""The byte layout of a snapshot: the zip file ``torch.save`` writes, laid out up front.

A snapshot in shared memory is, byte for byte, a file that ``torch.load`` reads: a zip
archive of stored (uncompressed) records under one top-level folder, ``data.pkl`` (the
pickled structure, tensors as references to storages), ``data/<key>`` (each storage's raw
bytes, 64-byte aligned as torch aligns them), and the small records torch's reader
expects. Persisting a snapshot is writing these bytes to a file; no torch is needed.

Everything here is plain bytes arithmetic (standard library only): the worker side plans
the layout (``plan``), copies each record's data to its offset itself, then fills in the
headers (``finish``) once every record's CRC-32 is known. Every entry uses zip64 fields,
so a rank's state may pass 4 GiB. Readers: torch's (miniz), Python's ``zipfile`` (which
checks each record's CRC-32: ``verify``).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

ALIGNMENT = 64  # torch's kFieldAlignment: storages start on this boundary
ARCHIVE = "archive"  # the top-level folder (torch takes whichever one the file has)

_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header, 30 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory header, 46 bytes
_ZIP64_LOCAL = struct.Struct("<HHQQ")  # id, size, uncompressed, compressed
_ZIP64_CENTRAL = struct.Struct("<HHQQQ")  # id, size, uncompressed, compressed, offset
_PAD_HEADER = struct.Struct("<HH")  # torch's "FB" padding extra field: id, size
_END64 = struct.Struct("<IQHHIIQQQQ")  # zip64 end of central directory record, 56 bytes
_LOCATOR = struct.Struct("<IIQI")  # zip64 end of central directory locator, 20 bytes
_END = struct.Struct("<IHHHHIIH")  # end of central directory record, 22 bytes
_VERSION = 45  # zip64
_FF32 = 0xFFFFFFFF
_PAD_ID = 0x4246  # "FB", as torch's writer


@dataclass(frozen=True)
class Record:
    """One planned entry: where its header and its data go."""

    name: str  # without the archive folder
    size: int
    header: int  # offset of its local header
    data: int  # offset of its first data byte (ALIGNMENT-aligned)

    @property
    def full_name(self) -> bytes:
        return f"{ARCHIVE}/{self.name}".encode()


@dataclass(frozen=True)
class Layout:
    """Where every record goes, and the total size (central directory included)."""

    records: tuple[Record, ...]
    directory: int  # offset of the central directory
    directory_size: int
    size: int


def plan(entries: Sequence[tuple[str, int]]) -> Layout:
    """Offsets for ``entries`` ((name, data size) in file order)."""
    offset = 0
    records: list[Record] = []
    for name, size in entries:
        fixed = _LOCAL.size + len(f"{ARCHIVE}/{name}".encode()) + _ZIP64_LOCAL.size
        data = _align(offset + fixed + _PAD_HEADER.size)
        records.append(Record(name, size, offset, data))
        offset = data + size
    directory_size = sum(_CENTRAL.size + len(r.full_name) + _ZIP64_CENTRAL.size
                         for r in records)
    size = offset + directory_size + _END64.size + _LOCATOR.size + _END.size
    return Layout(tuple(records), offset, directory_size, size)


def _align(offset: int) -> int:
    return (offset + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def finish(buffer: memoryview, layout: Layout, crcs: Sequence[int]) -> int:
    """Write every header, the central directory and its end records into ``buffer``
    (the records' data is already in place); returns the snapshot's checksum: the CRC-32
    of the central directory, which holds every record's CRC-32 and size."""
    for record, crc in zip(layout.records, crcs, strict=True):
        _write_local(buffer, record, crc)
    at = layout.directory
    for record, crc in zip(layout.records, crcs, strict=True):
        at = _write_central(buffer, at, record, crc)
    checksum = zlib.crc32(buffer[layout.directory:at])
    count = len(layout.records)
    _END64.pack_into(buffer, at, 0x06064B50, _END64.size - 12, _VERSION, _VERSION, 0, 0,
                     count, count, layout.directory_size, layout.directory)
    _LOCATOR.pack_into(buffer, at + _END64.size, 0x07064B50, 0, at, 1)
    _END.pack_into(buffer, at + _END64.size + _LOCATOR.size, 0x06054B50, 0, 0,
                   0xFFFF, 0xFFFF, _FF32, _FF32, 0)
    return checksum


def _write_local(buffer: memoryview, record: Record, crc: int) -> None:
    name = record.full_name
    at = record.header
    pad_at = at + _LOCAL.size + len(name) + _ZIP64_LOCAL.size
    pad = record.data - pad_at - _PAD_HEADER.size
    extra = _ZIP64_LOCAL.size + _PAD_HEADER.size + pad
    _LOCAL.pack_into(buffer, at, 0x04034B50, _VERSION, 0, 0, 0, 0x21, crc, _FF32, _FF32,
                     len(name), extra)
    buffer[at + _LOCAL.size:at + _LOCAL.size + len(name)] = name
    _ZIP64_LOCAL.pack_into(buffer, at + _LOCAL.size + len(name), 1, 16, record.size,
                           record.size)
    _PAD_HEADER.pack_into(buffer, pad_at, _PAD_ID, pad)
    buffer[pad_at + _PAD_HEADER.size:record.data] = b"Z" * pad


def _write_central(buffer: memoryview, at: int, record: Record, crc: int) -> int:
    name = record.full_name
    _CENTRAL.pack_into(buffer, at, 0x02014B50, _VERSION, _VERSION, 0, 0, 0, 0x21, crc,
                       _FF32, _FF32, len(name), _ZIP64_CENTRAL.size, 0, 0, 0, 0, _FF32)
    at += _CENTRAL.size
    buffer[at:at + len(name)] = name
    at += len(name)
    _ZIP64_CENTRAL.pack_into(buffer, at, 1, 24, record.size, record.size, record.header)
    return at + _ZIP64_CENTRAL.size


def directory_checksum(buffer: memoryview, size: int) -> int | None:
    """The checksum ``finish`` returned for the snapshot in ``buffer[:size]``, read back
    from its own end records; None if they are not where a finished snapshot has them."""
    end = size - _END.size - _LOCATOR.size - _END64.size
    if end < 0:
        return None
    fields = _END64.unpack_from(buffer, end)
    if fields[0] != 0x06064B50:
        return None
    directory_size, directory = fields[8], fields[9]
    if directory + directory_size != end:
        return None
    return zlib.crc32(buffer[directory:end])


def verify(buffer: memoryview, size: int, checksum: int) -> bool:
    """Whether ``buffer[:size]`` is the finished snapshot whose checksum is ``checksum``,
    every record's data included: the central directory's CRC-32 must be ``checksum``,
    and each record's data must have the CRC-32 and size the directory records for it.
    For bytes that came from elsewhere (a buddy's copy); reads every byte once."""
    if directory_checksum(buffer, size) != checksum:
        return False
    end = size - _END.size - _LOCATOR.size - _END64.size
    fields = _END64.unpack_from(buffer, end)
    count, at = fields[7], fields[9]
    for _ in range(count):
        if at + _CENTRAL.size > end:
            return False
        central = _CENTRAL.unpack_from(buffer, at)
        crc, name_len, extra_len = central[7], central[10], central[11]
        extra = at + _CENTRAL.size + name_len
        if central[0] != 0x02014B50 or extra_len < _ZIP64_CENTRAL.size:
            return False
        _id, _len, length, _compressed, header = _ZIP64_CENTRAL.unpack_from(buffer, extra)
        at = extra + extra_len + central[12]  # its comment, none in ours
        if header + _LOCAL.size > end:
            return False
        local = _LOCAL.unpack_from(buffer, header)
        data = header + _LOCAL.size + local[9] + local[10]
        if local[0] != 0x04034B50 or data + length > end:
            return False
        if zlib.crc32(buffer[data:data + length]) != crc:
            return False
    return bool(at == end)
