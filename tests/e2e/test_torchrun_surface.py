"""The rest of torchrun's flags, end to end through the daemon: virtual local rank,
``--run-path``, ``-m``, ``--no-python`` and ``--standalone``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemon import supervisor
from tests.support.paths import FAKE_WORKER, WORKERS

BASE = ["--health-port", "0", "--shutdown-timeout", "5"]

# a worker that says who it is in one write (lines of two ranks never interleave)
REPORT = (WORKERS / "surface_report.py").read_text()


def dumped_envs(out: Path, nproc: int) -> dict[int, dict[str, Any]]:
    return {r: json.loads((out / f"{r}.json").read_text()) for r in range(nproc)}


async def run_dump_env(tmp_path: Path, *flags: str, nproc: int = 2) -> dict[int, dict[str, Any]]:
    out = tmp_path / "env"
    out.mkdir()
    args = [*BASE, *flags, "--nproc-per-node", str(nproc), "--log-dir", str(tmp_path / "logs"),
            FAKE_WORKER, "--dump-env", str(out)]
    async with supervisor(args) as sup:
        assert await sup.wait() == 0
    return dumped_envs(out, nproc)


async def reports(args: list[str], cwd: Path | None = None) -> set[str]:
    seen: set[str] = set()
    async with supervisor([*BASE, "--nproc-per-node", "2", *args], cwd=cwd) as sup:
        for _ in range(2):
            seen.add((await sup.out.expect(r"^report ")).string)
        assert await sup.wait() == 0
    return seen


# ----------------------------------------------------------------------------- virtual rank


async def test_virtual_local_rank_gives_each_worker_device_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    envs = await run_dump_env(tmp_path, "--virtual-local-rank")
    assert [(e["RANK"], e["LOCAL_RANK"], e["CUDA_VISIBLE_DEVICES"]) for e in envs.values()] == [
        ("0", "0", "0"), ("1", "0", "1")]


async def test_virtual_local_rank_narrows_visible_devices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 6")
    envs = await run_dump_env(tmp_path, "--virtual-local-rank")
    assert [(e["LOCAL_RANK"], e["CUDA_VISIBLE_DEVICES"]) for e in envs.values()] == [
        ("0", "4"), ("0", "6")]


async def test_visible_devices_pass_through_without_virtual_local_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    envs = await run_dump_env(tmp_path)
    assert [(e["LOCAL_RANK"], e["CUDA_VISIBLE_DEVICES"]) for e in envs.values()] == [
        ("0", "4,6"), ("1", "4,6")]


async def test_too_few_devices_for_virtual_local_rank_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4")
    args = [*BASE, "--virtual-local-rank", "--nproc-per-node", "2", "--log-dir", str(tmp_path),
            FAKE_WORKER]
    async with supervisor(args) as sup:
        assert await sup.wait() == 2
    assert re.search(r"config error: virtual_local_rank: .*lists 1 device", sup.err.text())


# ----------------------------------------------------------------------------- what runs


async def test_run_path_runs_the_script_as_main(tmp_path: Path) -> None:
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    seen = await reports(["--run-path", "--log-dir", str(tmp_path / "logs"), str(script),
                          "--shard=${local_rank}"])
    assert seen == {"report __main__ 0 --shard=0", "report __main__ 1 --shard=1"}


async def test_module_flag_runs_python_dash_m(tmp_path: Path) -> None:
    (tmp_path / "surface_mod.py").write_text(REPORT)
    seen = await reports(["-m", "--log-dir", str(tmp_path / "logs"), "surface_mod", "x"],
                         cwd=tmp_path)
    assert seen == {"report __main__ 0 x", "report __main__ 1 x"}


async def test_no_python_runs_the_command_itself(tmp_path: Path) -> None:
    command = 'echo "report sh $RANK $0"'
    seen = await reports(["--no-python", "--log-dir", str(tmp_path / "logs"), "/bin/sh", "-c",
                          command, "${local_rank}"])
    assert seen == {"report sh 0 0", "report sh 1 1"}


async def test_standalone_picks_a_fresh_run_id(tmp_path: Path) -> None:
    envs = await run_dump_env(tmp_path, "--standalone")
    run_ids = {e["TORCHELASTIC_RUN_ID"] for e in envs.values()}
    assert len(run_ids) == 1
    run_id = run_ids.pop()
    assert re.fullmatch(r"[0-9a-f]{12}", run_id)
    assert (tmp_path / "logs" / run_id / "events.jsonl").is_file()
    assert all(e["MASTER_ADDR"] in ("127.0.0.1", "localhost") for e in envs.values())
