"""Real PyTorch DDP jobs (gloo, CPU) under elastic-supervisor and under torchrun."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import anyio
import pytest

from tests.support import deps
from tests.support.daemon import supervisor
from tests.support.etcd import EtcdMember
from tests.support.eventlog import warm_ranks
from tests.support.torchref import FINAL, STEPS, TRAIN, torchrun_final_loss

deps.need_module("torch")  # skips with how to install it (fails under .ci/run)
# torch training jobs (gloo, several ranks) each load both cores: one at a time, so that two
# of them never share the machine under xdist and run into the per-test timeout
pytestmark = [pytest.mark.torch, pytest.mark.xdist_group("torch")]

# --tee 3: every console line comes through the supervisor whole (prefixed "[default0]:")
TEE = ["--tee", "3"]


@pytest.fixture(scope="module")
def torchrun_loss(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The job's final loss under torchrun (run once per process, tests/support/torchref.py);
    each test compares its own run with it."""
    deps.need_marker("torch")  # before the tests' own check: module fixtures come first
    return torchrun_final_loss(tmp_path_factory.mktemp("torchrun"))


async def test_same_final_loss_as_torchrun(tmp_path: Path, torchrun_loss: str) -> None:
    expected = torchrun_loss
    args = [*TEE, "--health-port", "0", "--nproc-per-node", "2",
            "--log-dir", str(tmp_path / "logs"),
            TRAIN, *STEPS, "--checkpoint-dir", str(tmp_path / "ck")]
    async with supervisor(args) as sup:
        loss = (await sup.out.expect(FINAL, timeout=240)).group(1)
        assert await sup.wait() == 0
    assert loss == expected


async def test_killed_rank_restarts_and_resumes_from_checkpoint(tmp_path: Path,
                                                                torchrun_loss: str) -> None:
    args = [*TEE, "--health-port", "0", "--nproc-per-node", "2", "--max-restarts", "1",
            "--log-dir", str(tmp_path / "logs"), TRAIN, *STEPS,
            "--checkpoint-dir", str(tmp_path / "ck")]
    async with supervisor(args) as sup:
        started = sup.out.cursor  # rank 0's checkpoint may come before rank 1's first line
        pid = int((await sup.out.expect(r"rank 1/2 pid (\d+) starting at step 0",
                                        timeout=120)).group(1))
        await sup.out.expect(r"checkpoint at step 40$", timeout=120, since=started)
        os.kill(pid, signal.SIGKILL)
        resumed = await sup.out.expect(r"rank \d/2 pid \d+ starting at step (\d+) \(restart 1\)",
                                       timeout=120)
        assert int(resumed.group(1)) >= 40
        loss = (await sup.out.expect(FINAL, timeout=240)).group(1)
        assert await sup.wait() == 0
        await sup.err.expect(r"killed by SIGKILL")
    # resuming from the checkpoint reproduces the unbroken run exactly
    assert loss == torchrun_loss


async def test_exception_traceback_is_root_cause(tmp_path: Path) -> None:
    args = [*TEE, "--health-port", "0", "--nproc-per-node", "2",
            "--log-dir", str(tmp_path / "logs"),
            TRAIN, *STEPS, "--checkpoint-dir", str(tmp_path / "ck"), "--raise-at", "5"]
    async with supervisor(args) as sup:
        assert await sup.wait(timeout=240) == 1
        await sup.err.expect(r"root cause: local rank 1 .* exited with code 1: "
                             r"RuntimeError: injected failure at step 5")
    error_file = tmp_path / "logs" / "none" / "attempt_0" / "1" / "error.json"
    assert "Traceback" in error_file.read_text()


async def test_hung_rank_is_caught_by_its_deadline_and_the_job_resumes(
        tmp_path: Path, torchrun_loss: str) -> None:
    args = [*TEE, "--health-port", "0", "--nproc-per-node", "2", "--max-restarts", "1",
            "--log-dir", str(tmp_path / "logs"), TRAIN, *STEPS,
            "--checkpoint-dir", str(tmp_path / "ck"), "--hang-at", "50", "--step-timeout", "3"]
    async with supervisor(args) as sup:
        await sup.out.expect(r"rank 1 hanging at step 50$", timeout=120)
        # rank 1 sleeps inside the step; rank 0 waits for it in the step's allreduce. Both
        # armed 'train_step' at the same step, so either deadline may expire first: the
        # watchdog catching the hang is what matters, and no rank exited before it did
        caught = await sup.err.expect(
            r"deadline 'train_step' of local rank ([01]) .* expired", timeout=30)
        assert "(WorkerExited)" not in sup.err.text().split(caught.group(0))[0]
        resumed = await sup.out.expect(r"starting at step (\d+) \(restart 1\)", timeout=120)
        assert int(resumed.group(1)) == 40  # the last checkpoint before the hang
        loss = (await sup.out.expect(FINAL, timeout=240)).group(1)
        assert await sup.wait() == 0
    assert loss == torchrun_loss


@pytest.mark.etcd
async def test_two_nodes_over_etcd_train_like_one_group(tmp_path: Path, server: EtcdMember,
                                                        torchrun_loss: str) -> None:
    """One rank on each of two nodes ends with the loss of torchrun's two ranks on one node.
    (How ranks are laid out over nodes of several local ranks each is checked without
    torch: tests/e2e/test_multinode.py, which also runs two ranks per node.)"""
    losses: dict[int, list[str]] = {}  # node -> the final losses it printed
    async with anyio.create_task_group() as tg:

        async def node(n: int) -> None:
            args = [*TEE, "--health-port", "0", "--nnodes", "2", "--nproc-per-node", "1",
                    "--rdzv-backend", "etcd", "--rdzv-endpoint", server.endpoint,
                    "--rdzv-id", "ddp2x1", "--rdzv-conf", "last_call_timeout=1,lease_ttl=5",
                    "--log-dir", str(tmp_path / f"logs{n}"), TRAIN, *STEPS,
                    "--checkpoint-dir", str(tmp_path / "ck")]
            async with supervisor(args) as sup:
                assert await sup.wait(timeout=240) == 0
                losses[n] = [m.group(1) for line in sup.out.lines
                             if (m := re.search(FINAL, line))]

        for n in range(2):
            tg.start_soon(node, n)
    # rank 0 prints the final loss, on whichever node it is
    assert sorted(losses[0] + losses[1]) == [torchrun_loss]


async def test_preloaded_restart_resumes_to_torchruns_loss(tmp_path: Path,
                                                        torchrun_loss: str) -> None:
    """Rank 1 hangs at step 30 of the first attempt (forked, as every attempt is); once the
    restart's standbys are forked it is SIGKILLed; the restart runs in them, resumes from
    the step-20 checkpoint and ends with the loss of an unbroken torchrun run, as a cold
    restart does (the tests above)."""
    logs = tmp_path / "logs"
    args = [*TEE, "--health-port", "0", "--nproc-per-node", "2", "--max-restarts", "1",
            "--log-dir", str(logs), "--log-level", "info",
            "--preload", "torch,torch._dynamo", TRAIN, *STEPS,
            "--checkpoint-dir", str(tmp_path / "ck"), "--hang-at", "30",
            "--step-timeout", "600"]
    async with supervisor(args) as sup:
        pid = int((await sup.out.expect(r"rank 1/2 pid (\d+) starting at step 0",
                                        timeout=120)).group(1))
        await sup.out.expect(r"rank 1 hanging at step 30", timeout=120)
        for _ in range(4):  # the first attempt's standbys, then the restart's
            await sup.err.expect(r"standby for local rank \d preloaded torch,torch._dynamo in",
                                 timeout=120)
        os.kill(pid, signal.SIGKILL)
        await sup.out.expect(r"starting at step 20 \(restart 1\)", timeout=120)
        loss = (await sup.out.expect(FINAL, timeout=240)).group(1)
        assert await sup.wait() == 0
    assert warm_ranks(logs) == [[0, 1], [0, 1]]  # every attempt in the forked standbys
    assert loss == torchrun_loss
