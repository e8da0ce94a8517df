"""One snapshot step for a job over two nodes: two real supervisors on this machine (etcd
rendezvous against a real etcd, and c10d), one rank each, the DDP job of
``tests/workers/snapshot_ddp.py`` (torch CPU, gloo). After a rank's failure both nodes
restore one and the same step, whole, and compute the losses of the job run without a
failure (torchrun), bit for bit."""

from __future__ import annotations

import json
import signal
import uuid
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import pytest

from tests.e2e.test_snapshot_torch import RESTORED, STEPS, WORKER, Trace, reference
from tests.support import deps
from tests.support.daemon import Supervised, supervisor
from tests.support.etcd import EtcdMember
from tests.support.ports import free_port

deps.need_module("torch")
pytestmark = [pytest.mark.torch, pytest.mark.xdist_group("torch"), pytest.mark.timeout(300)]

__all__ = ["reference"]  # the torchrun run without a failure (a module fixture)


def node_args(tmp_path: Path, n: int, backend: list[str], *worker_args: str,
              restarts: int = 1) -> list[str]:
    (tmp_path / f"shm{n}").mkdir(parents=True, exist_ok=True)
    return ["--tee", "3", "--health-port", "0", "--nnodes", "2", "--nproc-per-node", "1",
            "--max-restarts", str(restarts), *backend, "--shutdown-timeout", "5",
            "--log-dir", str(tmp_path / f"logs{n}"),
            "--snapshot-memory-dir", str(tmp_path / f"shm{n}"),
            WORKER, str(tmp_path), "--steps", str(STEPS), *worker_args]


def etcd_backend(server: EtcdMember) -> list[str]:
    return ["--rdzv-backend", "etcd", "--rdzv-endpoint", server.endpoint,
            "--rdzv-id", f"snap-{uuid.uuid4().hex[:8]}",
            "--rdzv-conf", "last_call_timeout=1,lease_ttl=5"]


async def two_nodes(stack: AsyncExitStack, tmp_path: Path, backend: list[str],
                    *worker_args: str) -> list[Supervised]:
    return [await stack.enter_async_context(supervisor(node_args(tmp_path, n, backend,
                                                                 *worker_args)))
            for n in range(2)]


async def finish(nodes: list[Supervised]) -> Trace:
    for sup in nodes:
        assert await sup.wait(timeout=150) == 0, sup.err.text()[-3000:]
    return Trace.of([line for sup in nodes for line in sup.out.lines])


def assert_one_step_restored(trace: Trace, reference: Trace, steps: set[int]) -> int:
    """Both ranks (one per node) restored one step of ``steps`` in attempt 1, bit for bit
    what was saved, and the run computed the reference's losses."""
    step, restored = trace.restored_in(1)
    assert step in steps
    for rank in (0, 1):
        assert trace.saved[(rank, step)] == (True, reference.saved[(rank, step)][1])
    assert restored == reference.saved[(0, step)][1]
    assert trace.losses == reference.losses
    return step


@pytest.mark.etcd
async def test_two_nodes_restore_one_step_after_a_crashed_rank(
        tmp_path: Path, server: EtcdMember, reference: Trace) -> None:
    # rank 1 (the second node's) exits 3 right after its save of step 5 returned: that
    # save may still be completing (then the job's step is 4), never half of it
    async with AsyncExitStack() as stack:
        nodes = await two_nodes(stack, tmp_path, etcd_backend(server), "--crash-step", "5")
        trace = await finish(nodes)
    assert_one_step_restored(trace, reference, {4, 5})
    for sup in nodes:
        assert "agreeing on one step across nodes" not in sup.err.text()


@pytest.mark.etcd
async def test_two_nodes_one_step_apart_restore_their_common_step(
        tmp_path: Path, server: EtcdMember, reference: Trace) -> None:
    async with AsyncExitStack() as stack:
        nodes = await two_nodes(stack, tmp_path, etcd_backend(server), "--apart", "5")
        # the first node holds steps 4 and 5, the second node 4 (it never saves 5)
        await nodes[0].out.expect(r"rank 0 attempt 0 complete 5$", timeout=150)
        await nodes[1].out.expect(r"rank 1 attempt 0 complete 4$", timeout=150, since=0)
        (tmp_path / "go").write_text("")
        trace = await finish(nodes)
    assert "rank 1 attempt 0 saved 5" not in nodes[1].out.text()
    assert assert_one_step_restored(trace, reference, {4}) == 4


@pytest.mark.etcd
async def test_two_c10d_nodes_restore_one_step_after_a_crashed_rank(
        tmp_path: Path, reference: Trace) -> None:
    backend = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
               "--rdzv-id", f"snap-{uuid.uuid4().hex[:8]}"]
    async with AsyncExitStack() as stack:
        nodes = await two_nodes(stack, tmp_path, backend, "--crash-step", "5")
        trace = await finish(nodes)
    assert_one_step_restored(trace, reference, {4, 5})


async def wait_for_file(path: Path, timeout: float) -> bytes:
    """The file's bytes once it exists (written by rename: whole), bounded."""
    with anyio.fail_after(timeout):
        while not path.exists():
            await anyio.sleep(0.1)
    return path.read_bytes()


@pytest.mark.etcd
@pytest.mark.parametrize("mode", [[], ["--replicated"]], ids=["per-rank", "replicated"])
async def test_two_nodes_persist_one_step_in_parts_and_a_fresh_job_resumes_from_it(
        tmp_path: Path, server: EtcdMember, mode: list[str]) -> None:
    """Both nodes write their part of the step group rank 0 names (every second here) to
    one --snapshot-dir (replicated: group rank 0 writes the one copy); the job-wide
    marker names every rank's file. At the end both write their newest step; a new job
    (another run id, fresh memory) restores it from DIR on both nodes, bit for bit."""
    disk = tmp_path / "dir"
    flags = ("--snapshot-dir", str(disk), "--snapshot-persist-interval", "1")
    async with AsyncExitStack() as stack:
        nodes = await two_nodes(stack, tmp_path, [*etcd_backend(server), *flags],
                                "--hold", "4", *mode)
        for rank, sup in enumerate(nodes):
            await sup.out.expect(rf"rank {rank} attempt 0 complete 4$", timeout=150)
        marker = json.loads(await wait_for_file(disk / "step_4" / "complete.json", 30))
        assert marker["world_size"] == 2 and marker["replicated"] is bool(mode)
        if mode:
            assert marker["files"] == {"-1": "node0/node.pt"}
        else:  # each node wrote its own rank's file
            assert {marker["files"][r].split("/")[0] for r in "01"} == {"node0", "node1"}
        (tmp_path / "go").write_text("")
        first = await finish(nodes)
    assert (disk / f"step_{STEPS}" / "complete.json").exists()
    async with AsyncExitStack() as stack:
        nodes = await two_nodes(stack, tmp_path / "again", [
            *etcd_backend(server), *flags, "--snapshot-resume-any"], *mode)
        again = await finish(nodes)
    step, digest = again.restored_in(0)
    assert step == STEPS and digest == first.saved[(0, step)][1]
    how = "replicated" if mode else "1 rank(s)"
    for sup in nodes:
        assert f"this attempt restores step {STEPS} ({how}, from disk)" in sup.err.text()


@pytest.mark.etcd
async def test_a_node_that_replaces_a_lost_one_takes_its_ranks_state_from_the_dir(
        tmp_path: Path, server: EtcdMember, reference: Trace) -> None:
    """Both nodes hold step 4 and wrote it to DIR; one node dies (SIGKILL: its memory is
    gone) and a fresh node takes its place: the round's step is 4, which the survivor has
    in memory (or in DIR, if its rank moved) and the newcomer reads from DIR; both
    restore it, bit for bit, and the job computes the reference's losses."""
    disk = tmp_path / "dir"
    backend = [*etcd_backend(server), "--snapshot-dir", str(disk),
               "--snapshot-persist-interval", "1"]
    async with AsyncExitStack() as stack:
        nodes = await two_nodes(stack, tmp_path, backend, "--hold", "4")
        for rank, sup in enumerate(nodes):
            await sup.out.expect(rf"rank {rank} attempt 0 complete 4$", timeout=150)
        await wait_for_file(disk / "step_4" / "complete.json", 30)
        survivor, lost = nodes
        lost.signal(signal.SIGKILL)
        await lost.wait(timeout=30)
        (tmp_path / "go").write_text("")
        newcomer = await stack.enter_async_context(supervisor(node_args(
            tmp_path / "new", 0, backend)))
        for sup in (survivor, newcomer):
            assert await sup.wait(timeout=150) == 0, sup.err.text()[-3000:]
    saved = Trace.of(lost.out.lines).saved[(1, 4)][1]
    restored = [m for sup in (survivor, newcomer) for line in sup.out.lines
                if (m := RESTORED.search(line)) and m[3] != "0"]
    assert sorted((int(m[1]), int(m[3]), m[4]) for m in restored) == [
        (0, 4, saved), (1, 4, saved)]
    assert "from disk" in newcomer.err.text()
    trace = Trace.of([line for sup in (survivor, lost, newcomer) for line in sup.out.lines])
    assert trace.losses == reference.losses


@pytest.mark.etcd
async def test_a_job_that_fails_for_good_persists_the_newest_step_every_node_holds(
        tmp_path: Path, server: EtcdMember) -> None:
    """Ranks one step apart when the job fails for good (no restart left): the first node
    holds steps 4 and 5, the second 3 and 4; each writes its part of its two newest
    steps at the end, so step 4 is complete in DIR and step 5 (one part) is not."""
    disk = tmp_path / "dir"
    backend = [*etcd_backend(server), "--snapshot-dir", str(disk)]
    async with AsyncExitStack() as stack:
        nodes = [await stack.enter_async_context(supervisor(
            node_args(tmp_path, n, backend, "--apart", "5", restarts=0))) for n in range(2)]
        await nodes[0].out.expect(r"rank 0 attempt 0 complete 5$", timeout=150)
        await nodes[1].out.expect(r"rank 1 attempt 0 complete 4$", timeout=150, since=0)
        (tmp_path / "go").write_text("")
        for sup in nodes:
            assert await sup.wait(timeout=150) != 0
    marker = json.loads((disk / "step_4" / "complete.json").read_bytes())
    assert sorted(marker["files"]) == ["0", "1"]
    assert (disk / "step_5").is_dir() and not (disk / "step_5" / "complete.json").exists()
