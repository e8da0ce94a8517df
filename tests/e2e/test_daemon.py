"""End-to-end behaviour of the single-node daemon with real worker processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from tests.support.daemon import supervisor
from tests.support.paths import FAKE_WORKER, REPO
from tests.support.processes import pid_alive, wait_dead

BASE = ["--health-port", "0", "--shutdown-timeout", "5"]

# The variables torchrun 2.13's LocalElasticAgent sets for every worker (recorded from its
# source and a real run); values that change per run are checked separately.
TORCHRUN_KEYS = {
    "LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
    "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCHELASTIC_ERROR_FILE",
}


def events(log_dir: Path) -> list[dict[str, object]]:
    path = log_dir / "none" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_env_contract_per_rank(tmp_path: Path) -> None:
    out = tmp_path / "env"
    out.mkdir()
    args = [*BASE, "--nproc-per-node", "3", "--max-restarts", "2", "--role", "trainer",
            "--log-dir", str(tmp_path / "logs"), FAKE_WORKER, "--dump-env", str(out)]
    async with supervisor(args, env={"OMP_NUM_THREADS": "7"}) as sup:
        assert await sup.wait() == 0
    envs = {r: json.loads((out / f"{r}.json").read_text()) for r in range(3)}
    ports = {e["MASTER_PORT"] for e in envs.values()}
    assert len(ports) == 1 and ports.pop().isdigit()
    for rank, env in envs.items():
        assert env.keys() >= TORCHRUN_KEYS
        expected = {
            "LOCAL_RANK": str(rank), "RANK": str(rank), "GROUP_RANK": "0",
            "ROLE_RANK": str(rank), "ROLE_NAME": "trainer", "LOCAL_WORLD_SIZE": "3",
            "WORLD_SIZE": "3", "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "3",
            "MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_RUN_ID": "none",
            "TORCHELASTIC_USE_AGENT_STORE": "False", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "OMP_NUM_THREADS": "7",
            "TORCHELASTIC_ERROR_FILE": str(tmp_path / "logs" / "none" / "attempt_0" / str(rank)
                                           / "error.json"),
        }
        assert {k: env[k] for k in expected} == expected


async def test_crash_restarts_whole_group_with_restart_count(tmp_path: Path) -> None:
    args = [*BASE, "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", str(tmp_path),
            FAKE_WORKER, "--exit", "3", "--fail-rank", "1", "--fail-attempts", "1"]
    async with supervisor(args) as sup:
        await sup.out.expect(r"^ready 1 \d+ 0$")
        first = {(await sup.out.expect(r"^ready (\d) \d+ 1$")).group(1) for _ in range(2)}
        assert first == {"0", "1"}
        assert await sup.wait() == 0
    kinds = [e["event"] for e in events(tmp_path)]
    assert kinds.count("group_started") == 2
    assert "restart_scheduled" in kinds
    assert (tmp_path / "none" / "attempt_1").is_dir()


async def test_exhausted_restarts_pass_exit_code_through(tmp_path: Path) -> None:
    args = [*BASE, "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", str(tmp_path),
            FAKE_WORKER, "--exit", "7", "--fail-rank", "0"]
    async with supervisor(args) as sup:
        assert await sup.wait() == 7
        await sup.err.expect(r"restart budget exhausted \(1/1 used\)")
        await sup.err.expect(r"root cause: local rank 0 \(pid \d+\) exited with code 7")
    final = events(tmp_path)[-1]
    assert final["event"] == "finished" and final["exit_code"] == 7


async def test_exit_code_out_of_range_maps_to_1(tmp_path: Path) -> None:
    args = [*BASE, "--log-dir", str(tmp_path), FAKE_WORKER, "--exit", "200"]
    async with supervisor(args) as sup:
        assert await sup.wait() == 1


async def test_sigterm_graceful_stop_kills_worker_ignoring_term(tmp_path: Path) -> None:
    args = ["--health-port", "0", "--shutdown-timeout", "1", "--nproc-per-node", "2",
            "--log-dir", str(tmp_path), FAKE_WORKER, "--ignore-term"]
    async with supervisor(args) as sup:
        pids = [int((await sup.out.expect(r"^ready \d (\d+)")).group(1)) for _ in range(2)]
        started = time.monotonic()
        sup.signal(signal.SIGTERM)
        assert await sup.wait() == 128 + signal.SIGTERM
        assert time.monotonic() - started >= 1.0  # the grace was honoured
        assert not any(pid_alive(p) for p in pids)
    stop = [e for e in events(tmp_path) if e["event"] == "group_stopping"]
    assert stop[-1]["reason"] == "shutdown"


async def test_second_signal_escalates_to_kill_at_once(tmp_path: Path) -> None:
    args = ["--health-port", "0", "--shutdown-timeout", "60", "--log-dir", str(tmp_path),
            FAKE_WORKER, "--ignore-term"]
    async with supervisor(args) as sup:
        pid = int((await sup.out.expect(r"^ready 0 (\d+)")).group(1))
        sup.signal(signal.SIGTERM)
        await sup.err.expect(r"running -> stopping")
        sup.signal(signal.SIGINT)
        # without escalation this would wait the 60 s grace and fail the 15 s bound
        assert await sup.wait(timeout=15) == 128 + signal.SIGTERM
        assert not pid_alive(pid)


async def test_supervisor_sigkill_leaves_no_worker_or_grandchild(tmp_path: Path) -> None:
    pidfile = tmp_path / "gc"
    args = [*BASE, "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
            FAKE_WORKER, "--grandchild", str(pidfile)]
    async with supervisor(args) as sup:
        workers = [int((await sup.out.expect(r"^ready \d (\d+)")).group(1)) for _ in range(2)]
        grandchildren = [int((pidfile.parent / f"gc.{r}").read_text()) for r in range(2)]
        assert all(pid_alive(p) for p in workers + grandchildren)
        sup.signal(signal.SIGKILL)
        await sup.wait()
        await wait_dead(workers + grandchildren, timeout=1.0)


async def test_descendants_that_left_the_group_die_before_the_next_attempt(
    tmp_path: Path,
) -> None:
    pidfile = tmp_path / "gc"
    args = [*BASE, "--max-restarts", "1", "--log-dir", str(tmp_path / "logs"), FAKE_WORKER,
            "--grandchild", str(pidfile), "--grandchild-session", "--exit", "1",
            "--fail-attempts", "1"]
    async with supervisor(args) as sup:
        await sup.out.expect(r"^ready 0 \d+ 0$")
        # the first attempt's own file: gc.0 may already be the second attempt's
        grandchild = int((pidfile.parent / "gc.0.a0").read_text())
        await sup.out.expect(r"^ready 0 \d+ 1$")
        # the first attempt's grandchild (own session, parent gone) was swept by the stop
        assert not pid_alive(grandchild)
        sup.signal(signal.SIGTERM)
        assert await sup.wait() == 143


async def test_sigusr1_is_forwarded_and_nothing_else_happens(tmp_path: Path) -> None:
    args = [*BASE, "--nproc-per-node", "2", "--log-dir", str(tmp_path), FAKE_WORKER, "--trap", "1"]
    async with supervisor(args) as sup:
        for _ in range(2):
            await sup.out.expect(r"^ready")
        sup.signal(signal.SIGUSR1)
        got = {(await sup.out.expect(r"^got SIGUSR1 (\d)")).group(1) for _ in range(2)}
        assert got == {"0", "1"}
        sup.signal(signal.SIGUSR2)
        await sup.out.expect(r"^got SIGUSR2")
        sup.signal(signal.SIGHUP)  # reopen logs: must not stop the job
        await sup.err.expect(r"reopening log files")
        sup.signal(signal.SIGTERM)
        assert await sup.wait() == 128 + signal.SIGTERM
    kinds = [e["event"] for e in events(tmp_path)]
    assert kinds.count("group_started") == 1  # no restart from USR1/USR2/HUP


async def test_error_file_message_is_the_root_cause(tmp_path: Path) -> None:
    args = [*BASE, "--nproc-per-node", "2", "--log-dir", str(tmp_path), FAKE_WORKER,
            "--exit", "1", "--fail-rank", "1", "--error-message", "boom at step 7"]
    async with supervisor(args) as sup:
        assert await sup.wait() == 1
        await sup.err.expect(r"root cause: local rank 1 .* exited with code 1: "
                             r"RuntimeError: boom at step 7")
        await sup.err.expect(r"error file: .*attempt_0/1/error.json")


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor", *args], capture_output=True,
                          text=True, timeout=30, cwd=REPO)


def test_bad_flag_exits_2_with_one_line() -> None:
    result = _run_cli("run", "--max-restarts", "many", FAKE_WORKER)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "--max-restarts" in result.stderr


def test_bad_config_file_exits_2_naming_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text('max_restarts = "lots"\n')
    result = _run_cli("run", "--config", str(cfg), FAKE_WORKER)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "max_restarts" in result.stderr
    cfg.write_text("no_such_key = 1\n")
    result = _run_cli("check-config", str(cfg))
    assert result.returncode == 2 and "no_such_key" in result.stderr


def test_check_config_prints_resolved_settings(tmp_path: Path) -> None:
    cfg = tmp_path / "ok.toml"
    cfg.write_text('training_script = "train.py"\nnproc_per_node = "4"\nmax_restarts = 3\n')
    result = _run_cli("check-config", str(cfg))
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)
    assert resolved["max_restarts"] == 3 and resolved["nproc_per_node"] == "4"


def test_missing_script_is_a_usage_error(tmp_path: Path) -> None:
    result = _run_cli("run", "--health-port", "0", str(tmp_path / "nope.py"))
    assert result.returncode == 2
    assert "no such file" in result.stderr and len(result.stderr.splitlines()) == 1


async def test_flags_override_pet_environment(tmp_path: Path) -> None:
    out = tmp_path / "env"
    out.mkdir()
    args = [*BASE, "--nproc-per-node", "1", "--log-dir", str(tmp_path), FAKE_WORKER,
            "--dump-env", str(out)]
    env = {"PET_NPROC_PER_NODE": "2", "PET_MAX_RESTARTS": "4", "PET_ROLE": "envrole"}
    async with supervisor(args, env=env) as sup:
        assert await sup.wait() == 0
    dumped = json.loads((out / "0.json").read_text())
    assert dumped["LOCAL_WORLD_SIZE"] == "1"  # the flag won over PET_NPROC_PER_NODE
    assert dumped["TORCHELASTIC_MAX_RESTARTS"] == "4" and dumped["ROLE_NAME"] == "envrole"
    assert not (out / "1.json").exists()


def test_python_dash_m_is_the_same_program() -> None:
    result = _run_cli("--version")
    assert result.returncode == 0 and result.stdout.startswith("elastic-supervisor ")


async def test_local_rank_macro_is_substituted(tmp_path: Path) -> None:
    script = tmp_path / "echo.py"
    # one write per line: two workers share the console (no --tee), print() could interleave
    script.write_text(
        "import os, sys; os.write(1, ('args ' + ' '.join(sys.argv[1:]) + '\\n').encode())\n"
    )
    args = [*BASE, "--nproc-per-node", "2", "--log-dir", str(tmp_path), str(script),
            "--shard=${local_rank}"]
    async with supervisor(args) as sup:
        seen = {(await sup.out.expect(r"^args --shard=(\d)$")).group(1) for _ in range(2)}
        assert seen == {"0", "1"}
        assert await sup.wait() == 0


def test_no_python_command_runs_directly(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    result = _run_cli("run", "--health-port", "0", "--no-python", "--log-dir", str(tmp_path),
                      "touch", str(marker))
    assert result.returncode == 0, result.stderr
    assert marker.exists()
    assert os.path.exists(tmp_path / "none" / "events.jsonl")


@pytest.mark.xdist_group("load")  # a timing bound: not beside another test's load
async def test_supervisor_stays_responsive_after_many_quick_restarts(tmp_path: Path) -> None:
    args = [*BASE, "--nproc-per-node", "2", "--max-restarts", "10", "--log-dir", str(tmp_path),
            FAKE_WORKER, "--exit", "5", "--fail-rank", "0", "--fail-attempts", "10"]
    async with supervisor(args) as sup:
        assert await sup.wait(timeout=60) == 0
    with anyio.fail_after(1):
        kinds = [e["event"] for e in events(tmp_path)]
    assert kinds.count("group_started") == 11
    assert len(list((tmp_path / "none").glob("attempt_*"))) == 11
