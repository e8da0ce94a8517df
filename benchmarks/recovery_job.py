"""The real DDP job of ``benchmarks/recovery.py``: the same file under every launcher.

    recovery_job.py OUT_DIR --crashes K [--crash-after S] [--kill] [--step-sleep S]
                    [--loader-workers N]

torch CPU, gloo, ``nn.Linear(64, 64)`` under ``DistributedDataParallel``. Every attempt
whose restart count is below K ends with the last rank crashing (``exit 3``, or SIGKILL
with ``--kill``) at the first step past step 5 once S seconds went by since its first
step; the attempt K trains 5 steps and every rank exits 0. Each step sleeps
``--step-sleep`` (default 20 ms) after its all-reduce, as a GPU job's CPU waits on the
device: a CPU-only job that spins every core would be a job nothing else can share a CPU
with. Every rank writes ``OUT/a{restart}_r{rank}.json`` with wall-clock times of its
phases: ``start`` (the script runs), ``torch`` (``import torch`` done), ``pg``
(``init_process_group`` done), ``ddp`` (DDP constructed) and ``step`` (first step done);
the crashing rank writes ``OUT/crash_{restart}`` with the time just before it dies.
Deadlines go through ``FileTimerClient`` when the launcher gives a timer file, as a user's
job would: that is the job's progress signal.

``--loader-workers N`` (the busy node): each rank reads its inputs from a ``DataLoader``
with N worker processes whose every sample costs a few ms of CPU (as decoding and
augmenting do), and ``--step-sleep 0`` keeps the ranks busy too; the first step then
includes the DataLoader's first batch.
"""

from __future__ import annotations

import time

T_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import AbstractContextManager, nullcontext  # noqa: E402

import torch  # noqa: E402

T_TORCH = time.time()

import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--crashes", type=int, required=True)
    p.add_argument("--crash-after", type=float, default=5.0)
    p.add_argument("--kill", action="store_true")
    p.add_argument("--step-sleep", type=float, default=0.02)
    p.add_argument("--loader-workers", type=int, default=0)
    return p.parse_args()


class Preprocessed(torch.utils.data.Dataset[torch.Tensor]):
    """Samples that cost CPU to make, as decoded and augmented images do (~3 ms each)."""

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, index: int) -> torch.Tensor:
        x = torch.randn(96, 96)
        for _ in range(4):
            x = torch.tanh(x @ x.T / 96)
        return x[0, :64].clone()


def one_thread(_worker: int) -> None:
    torch.set_num_threads(1)


def inputs(loader_workers: int) -> Iterator[torch.Tensor]:
    """The batches each step trains on: random, or from a busy DataLoader."""
    if not loader_workers:
        while True:
            yield torch.randn(32, 64)
    loader = torch.utils.data.DataLoader(Preprocessed(), batch_size=16,
                                         num_workers=loader_workers,
                                         worker_init_fn=one_thread)
    yield from loader


def deadline() -> AbstractContextManager[object]:
    if os.environ.get("TORCHELASTIC_TIMER_FILE"):
        import torch.distributed.elastic.timer as timer

        return timer.expires(after=60, scope="step")
    return nullcontext()


def write(path: str, data: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def main() -> None:
    args = parse()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo")
    t_pg = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    if os.environ.get("TORCHELASTIC_TIMER_FILE"):
        import torch.distributed.elastic.timer as timer

        timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(64, 64))
    t_ddp = time.time()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    crashing = rank == world - 1 and restart < args.crashes
    first: float | None = None
    step = 0
    batches = inputs(args.loader_workers)
    while True:
        with deadline():
            x = next(batches)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        step += 1
        now = time.time()
        if first is None:
            first = now
            record = {"start": T_START, "torch": T_TORCH, "pg": t_pg, "ddp": t_ddp,
                      "step": now, "pid": os.getpid()}
            write(os.path.join(args.out, f"a{restart}_r{rank}.json"), json.dumps(record))
        if crashing and step > 5 and now - first >= args.crash_after:
            write(os.path.join(args.out, f"crash_{restart}"), repr(time.time()))
            if args.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(3)
        if restart >= args.crashes and step >= 5:
            break
        if args.step_sleep:
            time.sleep(args.step_sleep)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's C++ destructors can abort a finished process (see ddp_train.py)


if __name__ == "__main__":
    main()
