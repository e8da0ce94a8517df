"""A WorkerGroup with the null pool (no standbys): every rank starts cold, each exit is
reported into the inbox, and a stop ends every worker.

Component tests: real interpreters, no daemon around the group."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import anyio

from supervisor.config import Settings
from supervisor.core import state as sm
from supervisor.events import EventLog
from supervisor.rendezvous.base import RendezvousResult
from supervisor.workers.group import Attempt, WorkerGroup
from supervisor.workers.output import OutputPlan
from supervisor.workers.spawn import DeathSignal, Start, Worker, WorkerSpec, wait_exit
from supervisor.workers.warm.base import NullPool
from tests.support.paths import FAKE_WORKER

ROUND = RendezvousResult(round=1, group_rank=0, group_world_size=1, rank_offset=0,
                         world_size=2, master_addr="127.0.0.1", master_port=29999)


def _group(tmp_path: Path, args: list[str], post: list[sm.Event]) -> WorkerGroup:
    settings = Settings(training_script=FAKE_WORKER, training_script_args=args, nproc_per_node="2",
                        shutdown_timeout=5.0)
    return WorkerGroup(
        settings, run_id="job", events=EventLog(tmp_path / "events.jsonl", "job"),
        log_root=tmp_path / "logs", output=OutputPlan.from_settings(settings),
        environ={"PATH": "/usr/bin:/bin", "PYTHON_EXEC": sys.executable}, timer_file=None,
        post=post.append, death=DeathSignal(), pool=NullPool(), sweep_adopted=False,
    )


async def test_each_exit_is_posted_with_its_attempt_and_code(tmp_path: Path) -> None:
    posted: list[sm.Event] = []
    group = _group(tmp_path, ["--exit", "3"], posted)
    attempt, failed = await group.launch(1, 0, ROUND)
    assert failed == []
    assert [w.start for w in attempt.workers] == [Start(), Start()]  # cold, no reason
    with anyio.fail_after(30):
        await group.supervise(attempt)  # returns once both monitors reported
    exits = [e for e in posted if isinstance(e, sm.WorkerExited)]
    assert sorted((e.attempt, e.local_rank, e.exit_code) for e in exits) == [(1, 0, 3), (1, 1, 3)]
    await group.release()
    group.close()


async def test_a_death_by_signal_seen_with_an_exit_code_is_the_root_cause(
        tmp_path: Path) -> None:
    """Rank 0 exits 3, then rank 1 is SIGKILLed, both before the loop looks (as when it
    is busy while an OOM-killed rank's peer fails on the broken connection): rank 1's
    death is posted first, so it is the attempt's root cause."""
    posted: list[sm.Event] = []
    group = _group(tmp_path, ["--exit", "3", "--fail-rank", "0", "--hang"], posted)
    attempt, _ = await group.launch(1, 0, ROUND)
    rank0, rank1 = attempt.workers
    with anyio.fail_after(30):
        assert (await wait_exit(rank0)).exit_code == 3
        rank1.popen.kill()
        assert (await wait_exit(rank1)).signal == signal.SIGKILL
        await group.supervise(attempt)  # rank 0's monitor starts first and sees its exit
    exits = [(e.local_rank, e.exit_code, e.signal) for e in posted
             if isinstance(e, sm.WorkerExited)]
    assert exits == [(1, None, signal.SIGKILL), (0, 3, None)]
    await group.release()
    group.close()


async def test_a_stop_ends_every_worker_of_the_attempt(tmp_path: Path) -> None:
    posted: list[sm.Event] = []
    group = _group(tmp_path, ["--hang"], posted)
    attempt, _ = await group.launch(1, 0, ROUND)
    async with anyio.create_task_group() as tg:
        tg.start_soon(group.supervise, attempt)
        with anyio.fail_after(30):
            await group.stop(attempt, signal.SIGTERM)
    assert all(w.reaped for w in attempt.workers)
    assert attempt.stopping
    assert group.exempt() == set()  # the null pool holds no standby
    group.close()


class TellTake(NullPool):
    """Says when the group asks for rank 0's standby (there is none: it starts cold)."""

    def __init__(self) -> None:
        self.taken = anyio.Event()

    def take(self, spec: WorkerSpec) -> Worker | None:
        self.taken.set()
        return None


async def test_a_stop_decided_while_the_ranks_start_starts_no_further_rank(
        tmp_path: Path) -> None:
    """Ranks start one at a time with the loop running between them: a stop decided
    meanwhile ends the ranks already started and starts no other; the stop waits for the
    start to see it."""
    posted: list[sm.Event] = []
    group = _group(tmp_path, ["--hang"], posted)
    group.pool = pool = TellTake()
    attempt = group.begin(1, 0, ROUND)

    async def start_then_supervise() -> None:  # as the controller does
        await group.start(attempt)
        tg.start_soon(group.supervise, attempt)

    async with anyio.create_task_group() as tg:
        tg.start_soon(start_then_supervise)
        with anyio.fail_after(30):
            await pool.taken.wait()  # rank 0 is starting
            await group.stop(attempt, signal.SIGTERM)
    assert attempt.started.is_set()
    assert [w.local_rank for w in attempt.workers] == [0]  # rank 1 never started
    assert all(w.reaped for w in attempt.workers)
    group.close()


async def test_a_stop_decided_while_the_ranks_are_prepared_starts_none(
        tmp_path: Path) -> None:
    posted: list[sm.Event] = []
    group = _group(tmp_path, ["--hang"], posted)
    command = group.command
    holder: list[Attempt] = []

    def stop_at_rank_1(local_rank: int, global_rank: int, rank_dir: Path) -> list[str]:
        if local_rank == 1:
            holder[0].stopping = True
        return command(local_rank, global_rank, rank_dir)

    group.command = stop_at_rank_1
    attempt = group.begin(1, 0, ROUND)
    holder.append(attempt)
    with anyio.fail_after(30):
        assert await group.start(attempt) == []
    assert attempt.workers == [] and attempt.started.is_set()
    group.close()


def test_the_null_pool_never_gives_a_warm_worker(tmp_path: Path) -> None:
    pool = NullPool()
    assert pool.pids() == set()
    assert pool.cold_start(0) == Start(warm=False, cold_reason=None)


