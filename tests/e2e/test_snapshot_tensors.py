"""Snapshots of tensors (torch): bit for bit across a restart, and the tensors refused."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest

from tests.support.daemon import supervisor
from tests.support.paths import WORKERS

SAVER = str(WORKERS / "state_saver.py")
BASE = ["--health-port", "0", "--shutdown-timeout", "5"]

pytestmark = [pytest.mark.torch]


async def test_tensors_come_back_bit_for_bit_after_a_crash(tmp_path: Path) -> None:
    """Several dtypes and shapes, non-contiguous, aliased and zero-size tensors, a
    Parameter and plain values; each changed in place right after its save returned."""
    shm = tmp_path / "shm"
    shm.mkdir()
    args = [*BASE, "--nproc-per-node", "2", "--max-restarts", "1",
            "--snapshot-memory-dir", str(shm), SAVER, str(tmp_path), "--tensors",
            "--crash-rank", "0"]
    async with supervisor(args) as sup:
        for rank in (0, 1):
            await sup.out.expect(rf"rank {rank} attempt 1 restored 2$", timeout=60, since=0)
            await sup.out.expect(rf"rank {rank} tensors ok", timeout=30, since=0)
        assert await sup.wait(60) == 0


@pytest.mark.parametrize("kind", ["sparse", "subclass"])
async def test_tensors_snapshots_cannot_keep_are_refused_with_a_clear_error(
        tmp_path: Path, kind: str) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    args = [*BASE, "--snapshot-memory-dir", str(shm), SAVER, str(tmp_path), "--bad", kind]
    async with supervisor(args) as sup:
        found = await sup.out.expect(r"refused: (.*)", timeout=60)
        assert ("sparse" if kind == "sparse" else "subclass") in found.group(1)
        assert await sup.wait(60) == 0


def test_the_snapshot_layout_is_a_torch_save_file(tmp_path: Path) -> None:
    """What a slot holds is what torch.load reads (and a valid zip, CRCs and all)."""
    import mmap
    import sys

    import torch

    from supervisor.snapshots import worker as snapshot
    from supervisor.snapshots import zipformat

    state = {"w": torch.arange(6.0).reshape(2, 3).t(), "n": [1, "x"], "e": torch.empty(0)}
    # the worker side's own steps, without a supervisor: serialise, plan, copy, finish
    pickled, storages = snapshot._serialise(state)
    entries = [("data.pkl", len(pickled)), (".format_version", 1),
               (".storage_alignment", 2), ("byteorder", len(sys.byteorder))]
    entries += [(f"data/{key}", s.nbytes()) for key, s in storages] + [("version", 2)]
    layout = zipformat.plan(entries)
    region = mmap.mmap(-1, layout.size + 4096)
    snapshot._copy(region, layout, pickled, storages)
    with memoryview(region) as view:
        import zlib

        crcs = [zlib.crc32(view[r.data:r.data + r.size]) for r in layout.records]
        checksum = zipformat.finish(view, layout, crcs)
        assert zipformat.directory_checksum(view, layout.size) == checksum
        data = bytes(view[:layout.size])
    assert zipfile.ZipFile(io.BytesIO(data)).testzip() is None
    path = tmp_path / "step.pt"
    path.write_bytes(data)
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["w"], state["w"]) and loaded["w"].stride() == (1, 3)
    assert loaded["n"] == [1, "x"] and loaded["e"].numel() == 0
    assert torch.load(path, weights_only=True, mmap=True)["w"].sum() == 15


@pytest.mark.xdist_group("torch")
async def test_dcp_keeps_a_sharded_dtensor_state_in_memory_across_a_restart(
        tmp_path: Path) -> None:
    """dcp.save through snapshot.Writer, a crash, dcp.load through snapshot.Reader: each
    rank gets its shard of the step both ranks completed, bit for bit."""
    shm = tmp_path / "shm"
    shm.mkdir()
    args = [*BASE, "--nproc-per-node", "2", "--max-restarts", "1",
            "--snapshot-memory-dir", str(shm), str(WORKERS / "dcp_saver.py")]
    async with supervisor(args) as sup:
        for rank in (0, 1):
            await sup.out.expect(rf"rank {rank} saved 2 True", timeout=90, since=0)
        for rank in (0, 1):
            await sup.out.expect(rf"rank {rank} attempt 1 restored 2$", timeout=90, since=0)
            await sup.out.expect(rf"rank {rank} dcp ok 2", timeout=60, since=0)
        assert await sup.wait(120) == 0
