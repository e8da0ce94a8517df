"""A 2-rank job (torch CPU, gloo) that keeps a sharded DTensor state with DCP through
``snapshot.Writer`` and restores it with ``snapshot.Reader``.

    dcp_saver.py [--steps N]

The state: ``w``, an 8x4 float tensor sharded by rows over the 2 ranks (``Shard(0)``),
``b``, a plain tensor every rank holds, ``extra``, a bytes item; step ``s``'s values are
``arange + s``. Prints ``rank R attempt A restored S|none``, then ``rank R dcp ok S``
once the restored values are checked, and ``rank R saved S True|False``; in attempt 0,
rank 1 exits 3 after its saves.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from supervisor import snapshot


def say(text: str) -> None:
    """One write per line: ranks share the console, and under ``-u`` print() writes the
    text and its newline apart, so lines of two ranks could interleave."""
    os.write(1, (text + "\n").encode())


def state(mesh: object, step: int) -> dict[str, object]:
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4) + step
    return {"w": distribute_tensor(full, mesh, [Shard(0)]),  # type: ignore[arg-type]
            "b": torch.full((3,), float(step)), "extra": {"step": step}}


def main() -> int:
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 3
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    reader = snapshot.Reader()
    say(f"rank {rank} attempt {attempt} restored "
          f"{'none' if reader.step is None else reader.step}")
    start = 0
    if reader.step is not None:
        loaded = state(mesh, -1000)
        dcp.load(loaded, storage_reader=reader)
        want = state(mesh, reader.step)
        assert torch.equal(loaded["w"].to_local(), want["w"].to_local())  # type: ignore[attr-defined]
        assert torch.equal(loaded["b"], want["b"])  # type: ignore[arg-type]
        assert loaded["extra"] == {"step": reader.step}, loaded["extra"]
        say(f"rank {rank} dcp ok {reader.step}")
        start = reader.step + 1
    for step in range(start, start + steps):
        writer = snapshot.Writer(step=step)
        dcp.save(state(mesh, step), storage_writer=writer)
        say(f"rank {rank} saved {step} {writer.kept}")
    snapshot.Reader()  # loads, so returns once this rank's last save is complete
    dist.barrier()  # so rank 1's crash comes after every rank's last save is complete
    dist.destroy_process_group()
    if attempt == 0 and rank == 1:
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
