"""A snapshot from elsewhere is checked whole: every record's bytes against the save's
checksum (``zipformat.verify``)."""

from __future__ import annotations

import os
from pathlib import Path

from supervisor.snapshots import zipformat
from tests.support.snapshotbytes import snapshot_size, write_snapshot

PAYLOADS = {"data.pkl": b"pickle" * 100, "data/0": bytes(range(256)) * 64, "data/1": b""}


def _region(tmp_path: Path) -> tuple[bytearray, int, int]:
    path = tmp_path / "region"
    path.write_bytes(bytes(snapshot_size(PAYLOADS)))
    size, checksum = write_snapshot(path, PAYLOADS)
    return bytearray(path.read_bytes()), size, checksum


def test_an_intact_snapshot_passes(tmp_path: Path) -> None:
    data, size, checksum = _region(tmp_path)
    assert zipformat.verify(memoryview(data), size, checksum)


def test_a_flipped_data_byte_fails_though_the_directory_is_intact(tmp_path: Path) -> None:
    data, size, checksum = _region(tmp_path)
    layout = zipformat.plan([(n, len(d)) for n, d in PAYLOADS.items()])
    data[layout.records[1].data + 10] ^= 0xFF
    assert zipformat.directory_checksum(memoryview(data), size) == checksum
    assert not zipformat.verify(memoryview(data), size, checksum)


def test_another_saves_checksum_fails(tmp_path: Path) -> None:
    data, size, checksum = _region(tmp_path)
    assert not zipformat.verify(memoryview(data), size, checksum ^ 1)


def test_truncated_bytes_fail(tmp_path: Path) -> None:
    data, size, checksum = _region(tmp_path)
    half = bytearray(data[:size // 2]) + bytes(os.urandom(size - size // 2))
    assert not zipformat.verify(memoryview(half), size, checksum)
