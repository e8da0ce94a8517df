"""PyTorch's launcher test script ``bin/test_script_init_method.py``, as our own (torch's
test files are not in its wheel): ``init_process_group`` with the given ``init_method``
over gloo, then an all-reduce of one-hot vectors that must add up to the world size."""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description="test script")
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--world-size", type=int, default=int(os.getenv("WORLD_SIZE", "-1")))
    parser.add_argument("--rank", type=int, default=int(os.getenv("RANK", "-1")))
    args = parser.parse_args()
    dist.init_process_group(backend="gloo", init_method=args.init_method,
                            world_size=args.world_size, rank=args.rank)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    t = F.one_hot(torch.tensor(rank), num_classes=world_size)
    dist.all_reduce(t)  # every rank's one-hot: all ones
    derived = int(torch.sum(t).item())
    if derived != world_size:
        raise RuntimeError(f"expected a world size of {world_size}, the all-reduce gave {derived}")
    print("Done", flush=True)


if __name__ == "__main__":
    main()
