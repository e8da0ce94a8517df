"""A small DDP job (torch CPU, gloo) that keeps its state with ``supervisor.snapshot``.

    snapshot_ddp.py OUT [--steps N] [--replicated] [--crash-rank R] [--crash-step S]
                    [--kill-mid-save S] [--apart S] [--hold S] [--grow]

Two ``Linear(32, 32)`` layers with dropout, Adam; the batch of a step is seeded by (data
position, rank) and dropout draws from torch's global generator (seeded alike on every
rank), so the state (model, optimiser, RNG state, data position) is the same on every
rank and a run resumed from it computes the losses of a run that never failed, bit for
bit, at any world size (DDP keeps one gradient bucket layout: ``find_unused_parameters``).
Every step ends with ``snapshot.save(state, step)`` (``--replicated``: with
``replicated=True``). Prints, flushed:

- ``rank R attempt A pid P world W restored S digest D`` (S = 0: nothing to restore)
  once set up, D the digest of the state restored (``-`` for none);
- ``rank R attempt A step S loss HEX`` after each step (the rank's loss, ``float.hex``);
- ``rank R attempt A saved S True|False digest D`` after each save (D: SHA-256 of the
  state's tensors and values);
- ``rank R done`` at the end.

Faults, in attempt 0 only:

- ``--crash-rank R --crash-step S``: rank R exits 3 right after step S's save;
- ``--kill-mid-save S``: rank ``--crash-rank`` stops inside step S's ``save()``, between
  two of its tensor copies into the slot (a profile hook on torch's ``copy_``), prints
  ``rank R mid-save step S pid P`` and waits there to be killed;
- ``--apart S``: the other ranks save step S; rank ``--crash-rank`` finishes step S's
  training without saving it, waits for the file ``OUT/go`` (the test makes it once every
  rank said ``rank R attempt 0 complete K``: its last save is complete) and exits 3: the
  ranks hold steps one apart. A save completes in the background after ``save()``
  returns; ``load()`` waits for it first (what a rank calls here to be sure);
- ``--hold S``: every rank, its save of step S complete, says ``complete S`` and waits for
  ``OUT/go`` before it trains on (the test changes the job meanwhile);
- ``--grow``: the state also holds ``grown``, ``arange(256 * 2**step)`` (int64): it grows
  at every save (2 KiB at step 0, 1 MiB at step 9); a restored rank prints
  ``rank R grown ok N`` once it checked it, bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from supervisor import snapshot

WIDTH = 32


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--replicated", action="store_true")
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument("--crash-step", type=int, default=-1)
    p.add_argument("--kill-mid-save", type=int, default=-1)
    p.add_argument("--apart", type=int, default=-1)
    p.add_argument("--hold", type=int, default=-1)
    p.add_argument("--grow", action="store_true")
    return p.parse_args()


def say(text: str) -> None:
    """One write per line: ranks share the console, and under ``-u`` print() writes the
    text and its newline apart, so lines of two ranks could interleave."""
    os.write(1, (text + "\n").encode())


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                               torch.nn.Dropout(0.25), torch.nn.Linear(WIDTH, WIDTH))


def batch(pos: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(pos * 1_000_003 + rank)
    return torch.randn(8, WIDTH, generator=g)


def grown(step: int) -> torch.Tensor:
    return torch.arange(256 * 2**step, dtype=torch.int64)


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int,
             grow: bool) -> dict[str, Any]:
    state = {"model": model.state_dict(), "optim": opt.state_dict(),
             "rng": torch.get_rng_state(), "data_pos": step}
    if grow:
        state["grown"] = grown(step)
    return state


def digest(value: object, sha: Any = None) -> str:
    """SHA-256 of a nested state: its tensors' bytes, dtypes and shapes, and its values."""
    sha = sha or hashlib.sha256()
    if isinstance(value, torch.Tensor):
        sha.update(f"{value.dtype}{tuple(value.shape)}".encode())
        sha.update(value.detach().contiguous().numpy().tobytes())
    elif isinstance(value, dict):
        for key in sorted(value, key=repr):
            sha.update(repr(key).encode())
            digest(value[key], sha)
    elif isinstance(value, list | tuple):
        for item in value:
            digest(item, sha)
    else:
        sha.update(repr(value).encode())
    return str(sha.hexdigest()[:16])


def stop_mid_copy(rank: int, step: int) -> None:
    """From now on, the second tensor ``copy_`` of this thread prints a line and waits
    forever: the process is inside ``save()``, its slot half written."""
    copies = 0

    def hook(frame: object, event: str, arg: object) -> None:
        nonlocal copies
        if event == "c_call" and getattr(arg, "__name__", "") == "copy_":
            copies += 1
            if copies == 2:
                sys.setprofile(None)
                say(f"rank {rank} mid-save step {step} pid {os.getpid()}")
                threading.Event().wait()

    sys.setprofile(hook)


def complete(me: str, step: int) -> None:
    """Wait until this rank's last save is complete (``load()`` does so first; in attempt
    0 it has nothing to restore) and say so."""
    assert snapshot.load() is None
    say(f"{me} complete {step}")


def wait_for(path: Path, timeout: float = 90.0) -> None:
    """Until ``path`` exists (the test's word), bounded."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            say(f"no {path.name} within {timeout:.0f} s")
            os._exit(4)
        time.sleep(0.01)


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    me = f"rank {rank} attempt {attempt}"
    faulty = attempt == 0 and rank == args.crash_rank
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = 0
    restored = snapshot.load()
    restored_digest = "-"
    if restored is not None:
        step, state = restored
        restored_digest = digest(state)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        torch.set_rng_state(state["rng"])
        assert state["data_pos"] == step, (state["data_pos"], step)
        if args.grow:
            assert torch.equal(state["grown"], grown(step)), "grown differs"
            say(f"rank {rank} grown ok {state['grown'].numel()}")
    say(f"{me} pid {os.getpid()} world {dist.get_world_size()} restored {step} "
        f"digest {restored_digest}")
    # find_unused_parameters=True: DDP never lays its gradient buckets out again, so every
    # attempt reduces every step alike (beyond two ranks, gloo's sum depends on the layout:
    # docs/snapshots.md)
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    while step < args.steps:
        loss = ddp(batch(step, rank)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        say(f"{me} step {step} loss {float(loss.item()).hex()}")
        if faulty and step == args.apart:
            complete(me, step - 1)
            wait_for(args.out / "go")
            os._exit(3)
        if faulty and step == args.kill_mid_save:
            stop_mid_copy(rank, step)
        state = state_of(model, opt, step, args.grow)
        kept = snapshot.save(state, step, replicated=args.replicated)
        say(f"{me} saved {step} {kept} digest {digest(state)}")
        if attempt == 0 and step in (args.apart, args.hold):
            complete(me, step)
        if attempt == 0 and step == args.hold:
            wait_for(args.out / "go")
        if faulty and step == args.crash_step:
            os._exit(3)
    dist.barrier()
    say(f"rank {rank} done")
    os._exit(0)  # gloo's C++ destructors can abort a finished process (see ddp_train.py)


if __name__ == "__main__":
    main()
