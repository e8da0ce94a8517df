"""Training-state snapshots kept in the supervisor's memory: real daemon, real workers
(``tests/workers/state_saver.py``), a real socket and real shared memory."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import anyio
import pytest

from tests.support.daemon import Supervised, supervisor
from tests.support.paths import WORKERS
from tests.support.tmpfs import small_tmpfs

SAVER = str(WORKERS / "state_saver.py")
BASE = ["--health-port", "0", "--shutdown-timeout", "5", "--nproc-per-node", "2"]


def memory_args(directory: Path) -> list[str]:
    directory.mkdir(exist_ok=True)
    return ["--snapshot-memory-dir", str(directory)]


def regions_left(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.startswith("elastic-supervisor")]


async def finished(sup: Supervised, timeout: float = 60.0) -> int:
    return await sup.wait(timeout)


async def test_a_plain_state_is_restored_after_a_crash(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    args = [*BASE, *memory_args(shm), "--max-restarts", "1", "--log-dir", str(tmp_path / "logs"),
            SAVER, str(tmp_path), "--steps", "3", "--crash-rank", "1"]
    async with supervisor(args) as sup:
        for rank in (0, 1):
            await sup.out.expect(rf"rank {rank} attempt 0 saved 2 True", since=0)
        for rank in (0, 1):
            await sup.out.expect(rf"rank {rank} attempt 1 restored 2$", timeout=30, since=0)
        for rank in (0, 1):
            await sup.out.expect(rf"rank {rank} attempt 1 saved 5 True", since=0)
        assert await finished(sup) == 0
    for rank in (0, 1):
        restored = json.loads((tmp_path / f"restored_{rank}_1.json").read_text())
        assert restored["rank"] == rank and restored["step"] == 2
        assert restored["nested"] == {"list": [1, 2.5, "x", None, True], "tuple": [2, "t"]}
    assert regions_left(shm) == []  # freed when the job ended
    lines = [json.loads(line) for line in
             (tmp_path / "logs" / "none" / "events.jsonl").read_text().splitlines()]
    (chosen,) = [e for e in lines if e["event"] == "snapshot_restored"]
    assert chosen["step"] == 2 and chosen["source"] == "memory" and chosen["newest"] == 2
    (recovered,) = [e for e in lines if e["event"] == "recovered"]
    assert recovered["restored_step"] == 2 and recovered["steps_redone"] == 0
    assert recovered["state_from"] == "memory" and recovered["work_lost"] >= 0


async def test_a_step_not_above_the_last_is_refused(tmp_path: Path) -> None:
    args = [*BASE, *memory_args(tmp_path / "shm"), SAVER, str(tmp_path), "--again"]
    async with supervisor(args) as sup:
        await sup.out.expect(r"rank 0 again False")
        assert await finished(sup) == 0
    assert "must be above this rank's last one (2)" in sup.err.text() + sup.out.text()


async def test_a_state_above_the_memory_limit_is_not_kept(tmp_path: Path) -> None:
    args = [*BASE, *memory_args(tmp_path / "shm"), "--snapshot-memory-limit", "1M", SAVER,
            str(tmp_path), "--bytes", str(4 << 20)]
    async with supervisor(args) as sup:
        await sup.out.expect(r"rank 0 attempt 0 saved 2 False")
        assert await finished(sup) == 0  # training went on
    log = sup.err.text()  # the workers' stderr passes through it
    assert log.count("a snapshot save was not kept") == 1  # the supervisor's, then counted
    assert log.count("snapshot.save(step=0) not kept") == 2  # once per rank
    assert "snapshot.save(step=1)" not in log


async def test_a_full_tmpfs_refuses_the_save_cleanly(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "shm", size="2m") as shm:
        args = [*BASE, "--snapshot-memory-dir", str(shm), SAVER, str(tmp_path),
                "--bytes", str(8 << 20)]
        async with supervisor(args) as sup:
            for rank in (0, 1):
                await sup.out.expect(rf"rank {rank} attempt 0 saved 2 False", since=0)
            assert await finished(sup) == 0  # no SIGBUS, no failure: training went on
        assert "no room" in sup.err.text()
        assert regions_left(shm) == []


async def test_a_dead_supervisors_regions_are_swept(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = shm / f"elastic-supervisor-snapshots-{dead}-0000"
    stale.mkdir(mode=0o700)
    (stale / "rank0-slot0-gen1").write_bytes(b"old")
    async with supervisor([*BASE, *memory_args(shm), SAVER, str(tmp_path)]) as sup:
        assert await finished(sup) == 0
    assert not stale.exists()


async def test_regions_are_private(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    async with supervisor([*BASE, *memory_args(shm), str(WORKERS / "forger.py"),
                           str(tmp_path), "--save"]) as sup:
        await sup.out.expect(r"rank 0 saved True")  # and waits for OUT/go
        (directory,) = [p for p in shm.iterdir()]
        assert directory.stat().st_mode & 0o777 == 0o700
        assert {p.stat().st_mode & 0o777 for p in directory.iterdir()} == {0o600}
        assert len(list(directory.iterdir())) == 1
        port = await sup.serving()
        status = json.loads(await anyio.to_thread.run_sync(_get, port, "/status"))
        assert status["snapshots"]["memory_bytes"] == 1 << 20
        metrics = await anyio.to_thread.run_sync(_get, port, "/metrics")
        assert "elastic_supervisor_snapshot_memory_bytes 1.048576e+06" in metrics
        assert "elastic_supervisor_snapshot_saves_total 1.0" in metrics
        (tmp_path / "go").touch()
        assert await finished(sup) == 0


async def test_the_api_outside_a_supervisor_does_nothing_and_says_so_once(
        tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ELASTIC_SUPERVISOR_SNAPSHOT"}
    done = subprocess.run([sys.executable, SAVER, str(tmp_path), "--steps", "3"], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "rank 0 attempt 0 restored none" in done.stdout
    assert done.stdout.count("saved") == 3 and "True" not in done.stdout
    assert done.stderr.count("load() returns None") == 1
    assert done.stderr.count("save() returns False") == 1


def _get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return str(response.read().decode())


def _ask(path: str, payload: bytes) -> dict[str, object]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(payload)
        reply: dict[str, object] = json.loads(sock.makefile("rb").readline())
        return reply


@pytest.mark.parametrize("payload", [b"{not json\n", b'{"op": "restore"}\n',
                                     b'{"op": "reserve", "rank": 0, "step": "x"}\n',
                                     b'{"op": "restore", "rank": 0}\n'])
async def test_a_process_that_is_not_a_worker_is_refused(tmp_path: Path,
                                                         payload: bytes) -> None:
    """The test itself is no worker of the attempt: malformed or not, it gets nothing."""
    shm = tmp_path / "shm"
    args = [*BASE, *memory_args(shm), str(WORKERS / "forger.py"), str(tmp_path)]
    async with supervisor(args) as sup:
        found = await sup.out.expect(r"socket (\S+)")
        reply = await anyio.to_thread.run_sync(_ask, found.group(1), payload)
        assert reply["ok"] is False
        (tmp_path / "go").touch()
        assert await finished(sup) == 0


async def test_forged_and_malformed_messages_are_refused_and_counted(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    args = [*BASE, *memory_args(shm), str(WORKERS / "forger.py"), str(tmp_path), "--forge"]
    async with supervisor(args) as sup:
        for rank in (0, 1):
            await sup.out.expect(rf"rank {rank} forged refused: .*is rank {rank}, not rank",
                                 since=0)
            await sup.out.expect(rf"rank {rank} malformed refused: malformed", since=0)
            await sup.out.expect(rf"rank {rank} bogus commit refused", since=0)
            await sup.out.expect(rf"rank {rank} own restore ok", since=0)
        assert await finished(sup) == 0
    log = sup.err.text()
    assert log.count("snapshot socket: pid") == 1  # one line, the rest counted
    assert log.count("snapshot socket: malformed") == 1


async def test_a_supervisor_killed_by_sigkill_leaves_no_regions(tmp_path: Path) -> None:
    """Nothing of the supervisor runs after a SIGKILL: its guardian frees the memory."""
    shm = tmp_path / "shm"
    async with supervisor([*BASE, *memory_args(shm), str(WORKERS / "forger.py"),
                           str(tmp_path), "--save"]) as sup:
        await sup.out.expect(r"rank 0 saved True")
        assert regions_left(shm) != []
        sup.signal(signal.SIGKILL)
        await sup.wait()
        with anyio.fail_after(15):
            while regions_left(shm):
                await anyio.sleep(0.02)  # a removal by another process: no event to wait on
