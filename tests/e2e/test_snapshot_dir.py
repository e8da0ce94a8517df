"""``--snapshot-dir``: complete steps persisted from memory, a fresh run resumed from them,
and the directories a run must refuse."""

from __future__ import annotations

import io
import json
import os
import pwd
import signal
import zipfile
from pathlib import Path

from tests.support.daemon import supervisor
from tests.support.paths import WORKERS
from tests.support.tmpfs import fill, small_tmpfs

SAVER = str(WORKERS / "state_saver.py")
BASE = ["--health-port", "0", "--shutdown-timeout", "5"]


def args_for(tmp_path: Path, disk: Path, *extra: str, flags: tuple[str, ...] = (),
             nproc: int = 2) -> list[str]:
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    return [*BASE, "--nproc-per-node", str(nproc), "--snapshot-memory-dir", str(shm),
            "--snapshot-dir", str(disk), "--log-dir", str(tmp_path / "logs"), *flags, SAVER,
            str(tmp_path), *extra]


def complete_steps(disk: Path) -> list[int]:
    return sorted(int(p.parent.name[5:]) for p in disk.glob("step_*/complete.json"))


async def test_sigterm_persists_the_newest_step_and_a_fresh_run_resumes_from_it(
        tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    async with supervisor(args_for(tmp_path, disk, "--steps", "4", "--hold")) as sup:
        for rank in (0, 1):
            await sup.out.expect(rf"rank {rank} holding", since=0)
        sup.signal(signal.SIGTERM)
        assert await sup.wait(60) == 128 + signal.SIGTERM
    assert complete_steps(disk) == [3]
    marker = json.loads((disk / "step_3" / "complete.json").read_text())
    assert marker["files"] == {"0": "node0/rank0.pt", "1": "node0/rank1.pt"}
    manifest = json.loads((disk / "manifest.json").read_text())
    assert manifest == {"format": 1, "run_id": "none", "world_size": 2}
    data = (disk / "step_3" / "node0" / "rank1.pt").read_bytes()
    assert zipfile.ZipFile(io.BytesIO(data)).testzip() is None  # every CRC-32 checks
    async with supervisor(args_for(tmp_path, disk, "--steps", "2")) as sup:
        for rank in (0, 1):
            await sup.out.expect(rf"rank {rank} attempt 0 restored 3$", timeout=30, since=0)
        assert await sup.wait(60) == 0
    for rank in (0, 1):
        restored = json.loads((tmp_path / f"restored_{rank}_0.json").read_text())
        assert restored["rank"] == rank and restored["step"] == 3
    assert complete_steps(disk) == [3, 5]  # the end of the second run: the last two kept


async def test_a_job_that_fails_for_good_persists_its_newest_step(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    async with supervisor(args_for(tmp_path, disk, "--steps", "3", "--crash-rank", "1")
                          ) as sup:
        assert await sup.wait(60) == 3
    assert complete_steps(disk) == [2]


async def test_a_dir_of_another_run_is_not_resumed(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir(mode=0o700)
    (disk / "manifest.json").write_text(json.dumps(
        {"format": 1, "run_id": "another", "world_size": 2}))
    async with supervisor(args_for(tmp_path, disk, "--steps", "1")) as sup:
        for rank in (0, 1):
            await sup.out.expect(rf"rank {rank} attempt 0 restored none", since=0)
        assert await sup.wait(60) == 0
    assert sup.err.text().count("holds run 'another'") == 1
    assert complete_steps(disk) == []  # nor written: the other run's steps stay its own


async def test_a_malformed_manifest_is_refused_with_one_line(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir(mode=0o700)
    (disk / "manifest.json").write_text("{not json")
    async with supervisor(args_for(tmp_path, disk, "--steps", "1")) as sup:
        await sup.out.expect(r"rank 0 attempt 0 restored none")
        assert await sup.wait(60) == 0
    assert sup.err.text().count("not a format 1 manifest") == 1


async def test_a_marker_naming_a_path_outside_dir_is_not_followed(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    step = disk / "step_7"
    step.mkdir(parents=True, mode=0o700)
    (disk / "manifest.json").write_text(json.dumps(
        {"format": 1, "run_id": "none", "world_size": 2}))
    (step / "complete.json").write_text(json.dumps(
        {"format": 1, "step": 7, "world_size": 2, "replicated": False,
         "files": {"0": "../../secret.pt", "1": "node0/rank1.pt"}}))
    async with supervisor(args_for(tmp_path, disk, "--steps", "1")) as sup:
        await sup.out.expect(r"rank 0 attempt 0 restored none")
        assert await sup.wait(60) == 0


async def test_a_dir_owned_by_another_user_stops_the_start(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir(mode=0o700)
    os.chown(disk, pwd.getpwnam("nobody").pw_uid, -1)
    async with supervisor(args_for(tmp_path, disk)) as sup:
        assert await sup.wait(30) == 2
    assert "snapshot_dir:" in sup.err.text() and "owned by uid" in sup.err.text()


async def test_a_full_dir_warns_once_and_training_goes_on(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "disk", size="1m") as disk:
        fill(disk)
        args = args_for(tmp_path, disk, "--steps", "3", "--bytes", str(64 << 10), "--hold",
                        flags=("--snapshot-persist-interval", "0.2"))
        async with supervisor(args) as sup:
            await sup.err.expect(r"snapshot_dir: cannot write step \d+", timeout=30)
            (tmp_path / "go").touch()
            assert await sup.wait(60) == 0
        assert sup.err.text().count("snapshot_dir: cannot write") == 1
        assert complete_steps(disk) == []
        assert not list(disk.glob("step_*/node0/*.part"))


async def test_per_rank_steps_of_another_world_size_are_not_resumed(tmp_path: Path) -> None:
    """Per-rank snapshots are shards of a world of two: a world of one starts afresh."""
    disk = tmp_path / "disk"
    async with supervisor(args_for(tmp_path, disk, "--steps", "2")) as sup:
        assert await sup.wait(60) == 0
    assert complete_steps(disk) == [1]
    async with supervisor(args_for(tmp_path, disk, "--steps", "1", nproc=1)) as sup:
        await sup.out.expect(r"rank 0 attempt 0 restored none", timeout=30)
        assert await sup.wait(60) == 0


async def test_a_region_changed_after_its_commit_is_never_persisted(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    async with supervisor(args_for(tmp_path, disk, "--steps", "1", "--hold", nproc=1)) as sup:
        await sup.out.expect(r"rank 0 holding")
        (region,) = (tmp_path / "shm").glob("elastic-supervisor-snapshots-*/rank0-slot0-*")
        with open(region, "r+b") as f:
            f.write(bytes(4096))  # a stray write over the snapshot its worker committed
        sup.signal(signal.SIGTERM)
        assert await sup.wait(60) == 128 + signal.SIGTERM
    assert "snapshot_dir: cannot write step 0" in sup.err.text()
    assert complete_steps(disk) == []
