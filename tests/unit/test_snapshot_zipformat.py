"""The snapshot byte layout is a zip file (torch.save's) that the standard library reads."""

from __future__ import annotations

import io
import zipfile
import zlib

from supervisor.snapshots import zipformat


def build(records: dict[str, bytes], slack: int = 0) -> tuple[bytearray, zipformat.Layout,
                                                              int]:
    layout = zipformat.plan([(name, len(data)) for name, data in records.items()])
    buffer = bytearray(layout.size + slack)
    view = memoryview(buffer)
    for record, data in zip(layout.records, records.values(), strict=True):
        view[record.data:record.data + record.size] = data
    checksum = zipformat.finish(view, layout, [zlib.crc32(d) for d in records.values()])
    return buffer, layout, checksum


def test_every_record_is_readable_and_its_crc_checks() -> None:
    records = {"data.pkl": b"pickled", "data/0": bytes(range(256)) * 9, "data/1": b"",
               "version": b"3\n"}
    buffer, _, _ = build(records)
    archive = zipfile.ZipFile(io.BytesIO(bytes(buffer)))
    assert archive.testzip() is None
    assert {n: archive.read(n) for n in archive.namelist()} == {
        f"archive/{k}": v for k, v in records.items()}


def test_storages_start_on_64_byte_boundaries() -> None:
    _, layout, _ = build({"data.pkl": b"x" * 13, "data/0": b"y" * 100, "data/1": b"z"})
    assert all(r.data % zipformat.ALIGNMENT == 0 for r in layout.records)


def test_the_checksum_is_read_back_from_the_snapshot_itself() -> None:
    buffer, layout, checksum = build({"data.pkl": b"p", "data/0": b"q" * 1000}, slack=4096)
    view = memoryview(buffer)
    assert zipformat.directory_checksum(view, layout.size) == checksum
    record = layout.records[1]
    view[record.header + 14] ^= 0xFF  # a byte of that record's CRC-32 in its local header
    assert zipformat.directory_checksum(view, layout.size) == checksum  # central dir intact
    view[layout.directory + 16] ^= 0xFF  # a byte of the first CRC-32 in the directory
    assert zipformat.directory_checksum(view, layout.size) != checksum


def test_a_size_that_is_not_a_finished_snapshot_has_no_checksum() -> None:
    buffer, layout, _ = build({"data.pkl": b"p"}, slack=4096)
    view = memoryview(buffer)
    assert zipformat.directory_checksum(view, layout.size + 64) is None
    assert zipformat.directory_checksum(view, 10) is None

