"""A sharded job (FSDP2 on CPU, gloo) that keeps its state in memory through DCP.

    snapshot_dcp.py OUT [--steps N] [--crash-rank R] [--crash-step S]

Two ``Linear(16, 16)`` layers under ``fully_shard`` on a 1-D mesh of every rank, Adam; the
model and optimiser state dicts (``get_state_dict``: DTensors, each rank holding its
shards) are saved every step with ``dcp.save(state, storage_writer=snapshot.Writer(step=
step))`` and restored with ``dcp.load(state, storage_reader=snapshot.Reader())``. Prints,
flushed:

- ``rank R attempt A restored S digest D`` (S = 0, D ``-``: nothing restored), D the
  SHA-256 of this rank's shards and values once loaded;
- ``rank R attempt A saved S digest D`` after each save, D the same digest of what it
  saved;
- ``rank R attempt A step S loss HEX``; ``rank R done`` at the end.

Rank ``--crash-rank`` exits 3 right after step ``--crash-step``'s save in attempt 0.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from supervisor import snapshot

WIDTH = 16


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument("--crash-step", type=int, default=-1)
    return p.parse_args()


def say(text: str) -> None:
    """One write per line: ranks share the console, and under ``-u`` print() writes the
    text and its newline apart, so lines of two ranks could interleave."""
    os.write(1, (text + "\n").encode())


def digest(value: object, sha: Any = None) -> str:
    """SHA-256 of a nested state: this rank's local shards of DTensors, tensors, values."""
    sha = sha or hashlib.sha256()
    if isinstance(value, DTensor):
        sha.update(f"{value.placements}{tuple(value.shape)}".encode())
        value = value.to_local()
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


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 1_000_003 + rank)
    return torch.randn(4, WIDTH, generator=g)


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    me = f"rank {rank} attempt {attempt}"
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                                torch.nn.Linear(WIDTH, WIDTH))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    # one step before anything is restored: the optimiser's state exists to load into
    model(batch(0, rank)).sum().backward()
    opt.step()
    opt.zero_grad()
    step, restored = 0, "-"
    reader = snapshot.Reader()
    if reader.step is not None:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, storage_reader=reader)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        step = int(reader.step)
        restored = digest(dict(zip(("model", "optim"), get_state_dict(model, opt),
                                   strict=True)))
    say(f"{me} restored {step} digest {restored}")
    while step < args.steps:
        loss = model(batch(step + 1, rank)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        step += 1
        say(f"{me} step {step} loss {float(loss.item()).hex()}")
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.save(state, storage_writer=snapshot.Writer(step=step))
        say(f"{me} saved {step} digest {digest(state)}")
        if attempt == 0 and rank == args.crash_rank and step == args.crash_step:
            os._exit(3)
    dist.barrier()
    say(f"rank {rank} done")
    os._exit(0)  # gloo's C++ destructors can abort a finished process (see ddp_train.py)


if __name__ == "__main__":
    main()
