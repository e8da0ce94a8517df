"""The DDP job of ``benchmarks/state_recovery.py``: the same file under every launcher.

    state_job.py OUT --mode {torchsave,snapshot,replicated,none} [--steps N]
                 [--params-mib M] [--every K] [--crash-rank R] [--crash-step S]
                 [--crash-every SECONDS --t0 WALL]

torch CPU, gloo, one thread per rank. The model is four ``Linear(W, W)`` layers with
dropout (``W`` chosen so the parameters take ``--params-mib``, 64 MiB by default), under
``DistributedDataParallel``, trained with Adam: about 3x the parameters of state per rank
(parameters, ``exp_avg``, ``exp_avg_sq``), 192 MiB by default. The batch of a step comes
from a generator seeded by (data position, rank), and dropout draws from torch's global
generator, seeded alike on every rank: the state to keep is the model, the optimiser,
torch's RNG state and the data position, the same on every rank (so ``replicated=True``
is true of it), and a run resumed from it computes, bit for bit, the losses of a run that
never failed, at any world size: DDP runs with ``find_unused_parameters=True``, which
keeps its gradient buckets as built (see ``main``).

Modes:

- ``torchsave``: as torchrun users write it: every ``--every`` steps (20), after a
  barrier, rank 0 writes the state with ``torch.save`` to ``OUT/ckpt/last.pt`` (a
  temporary file, then a rename), then a barrier; a restarted rank loads that file.
- ``snapshot``: ``supervisor.snapshot.save(state, step)`` every step on every rank;
  a restarted rank resumes from ``snapshot.load()``.
- ``replicated``: the same with ``replicated=True``.
- ``none``: no saves, no resume (the goodput reference of ``--long``).

Rank ``--crash-rank`` (1) exits 3 right after step ``--crash-step`` (35) of attempt 0
(its save done); with ``--crash-every S``, every attempt's crash comes instead at the
first step past ``--t0 + S * (attempt + 1)`` (wall clock), and the job never crashes
before that. ``--steps 0`` trains until stopped.

Records, for the harness: every rank appends JSON lines to ``OUT/r{rank}.jsonl`` (one
``os.write`` of an ``O_APPEND`` file each): ``start`` (the script runs), ``restore`` (the
step restored, where from, the wall clock around the load), ``step`` (its wall-clock end
and the rank's loss as ``float.hex``), ``save`` (everything ``save()`` or the checkpoint
block did before returning, in seconds, and whether it was kept); the crashing rank writes
``OUT/crash_{attempt}`` (its wall clock just before it exits).
"""

from __future__ import annotations

import time

T_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

LAYERS = 4
BATCH = 16


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--mode", choices=("torchsave", "snapshot", "replicated", "none"),
                   required=True)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--params-mib", type=float, default=64.0)
    p.add_argument("--every", type=int, default=20, help="steps between torch.save's")
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument("--crash-step", type=int, default=35, help="-1: never")
    p.add_argument("--crash-every", type=float, default=0.0)
    p.add_argument("--t0", type=float, default=0.0)
    return p.parse_args()


def width(params_mib: float) -> int:
    """The layers' width whose LAYERS weight matrices (float32) take ``params_mib``."""
    return max(8, int(math.sqrt(params_mib * 2**20 / 4 / LAYERS)))


def make_model(w: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Dropout(0.1)]
    return torch.nn.Sequential(*layers[:-2])


def batch(pos: int, rank: int, w: int) -> torch.Tensor:
    """Synthetic data at position ``pos`` of ``rank``'s stream."""
    g = torch.Generator().manual_seed(pos * 1_000_003 + rank)
    return torch.randn(BATCH, w, generator=g)


class Records:
    """This rank's JSON lines (each one atomic write to an O_APPEND file)."""

    def __init__(self, out: Path, rank: int, attempt: int) -> None:
        self.fd = os.open(out / f"r{rank}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.attempt = attempt

    def __call__(self, ev: str, **fields: object) -> None:
        os.write(self.fd, (json.dumps({"ev": ev, "a": self.attempt, **fields}) + "\n").encode())


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer, pos: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(),
            "rng": torch.get_rng_state(), "data_pos": pos}


def nbytes(value: object) -> int:
    """The bytes of the tensors in a nested state."""
    if isinstance(value, torch.Tensor):
        return value.nelement() * value.element_size()
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(nbytes(v) for v in value)
    return 0


def restore(state: dict[str, Any], model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    torch.set_rng_state(state["rng"])
    return int(state["data_pos"])


def load(args: argparse.Namespace, model: torch.nn.Module,
         opt: torch.optim.Optimizer) -> tuple[int, str | None]:
    """The step restored (0: none) and where it came from."""
    if args.mode == "torchsave":
        path = args.out / "ckpt" / "last.pt"
        if not path.exists():
            return 0, None
        state = torch.load(path, map_location="cpu", weights_only=True)
        restore(state, model, opt)
        return int(state["step"]), "file"
    if args.mode in ("snapshot", "replicated"):
        from supervisor import snapshot

        found = snapshot.load()
        if found is None:
            return 0, None
        step, state = found
        restore(state, model, opt)
        return step, "snapshot"
    return 0, None


def save(args: argparse.Namespace, model: torch.nn.Module, opt: torch.optim.Optimizer,
         step: int, rank: int) -> bool | None:
    """This step's save, if the mode makes one now: whether it was kept."""
    if args.mode == "torchsave":
        if step % args.every:
            return None
        dist.barrier()  # every rank finished the step
        if rank == 0:
            path = args.out / "ckpt" / "last.pt"
            tmp = path.with_suffix(".tmp")
            torch.save({**state_of(model, opt, step), "step": step}, tmp)
            os.replace(tmp, path)
        dist.barrier()  # nobody goes on (and may crash) before the file is there
        return True
    if args.mode in ("snapshot", "replicated"):
        from supervisor import snapshot

        return snapshot.save(state_of(model, opt, step), step,
                             replicated=args.mode == "replicated")
    return None


def crashes_now(args: argparse.Namespace, rank: int, attempt: int, step: int) -> bool:
    if rank != args.crash_rank:
        return False
    if args.crash_every > 0:
        return time.time() >= args.t0 + args.crash_every * (attempt + 1)
    return attempt == 0 and step == args.crash_step


def main() -> None:
    args = parse()
    torch.set_num_threads(1)  # the same reduction order in every run, under every launcher
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rec = Records(args.out, rank, attempt)
    rec("start", t=T_START, pid=os.getpid(), world=dist.get_world_size())
    (args.out / "ckpt").mkdir(exist_ok=True)
    w = width(args.params_mib)
    model = make_model(w)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    t0 = time.time()
    step, source = load(args, model, opt)
    rec("restore", step=step, source=source, t0=t0, t1=time.time())
    # find_unused_parameters=True: DDP never lays its gradient buckets out again after the
    # first step. Beyond two ranks gloo's sum depends on an element's place in its bucket,
    # and a restarted attempt's first step would reduce with the initial layout where the
    # unbroken run used the rebuilt one (docs/snapshots.md, "Bit for bit under DDP")
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    while args.steps <= 0 or step < args.steps:
        x = batch(step, rank, w)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        rec("step", step=step, t=time.time(), loss=float(loss.item()).hex())
        before = time.perf_counter()
        kept = save(args, model, opt, step, rank)
        if kept is not None:
            dt = time.perf_counter() - before
            rec("save", step=step, dt=dt, ok=kept, bytes=nbytes(state_of(model, opt, step)))
        if crashes_now(args, rank, attempt, step):
            (args.out / f"crash_{attempt}").write_text(repr(time.time()))
            os._exit(3)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # gloo's C++ destructors can abort a finished process (see ddp_train.py)


if __name__ == "__main__":
    main()
