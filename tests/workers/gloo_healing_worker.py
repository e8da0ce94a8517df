"""A real collective job for the healing tests: a gloo all-reduce every 50 ms.

Prints ``ready RANK NODE world W`` once the process group is up. A worker on a bad node
($HEAL_BAD=1) exits 1 at its next step once ``--bad-gate`` exists, so the healthy ranks'
all-reduce breaks and they fail too: remote consequences. Once ``--done`` exists on any
rank, every rank learns it through the all-reduce and all exit 0 together.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist

STEP = 0.05


def say(text: str) -> None:
    os.write(1, (text + "\n").encode())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bad-gate", required=True)
    p.add_argument("--done", required=True)
    p.add_argument("--step-timeout", type=float, default=2.0,
                   help="a step's all-reduce gives up after this (a dead peer may not "
                   "reset the connection: gloo would wait its default 30 min)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    steps = dist.new_group(timeout=datetime.timedelta(seconds=args.step_timeout))
    rank, node = dist.get_rank(), os.environ.get("HEAL_NODE", "?")
    bad = os.environ.get("HEAL_BAD") == "1"
    say(f"ready {rank} {node} world {dist.get_world_size()}")
    while True:
        if bad and os.path.exists(args.bad_gate):
            say(f"failing {rank} {node}")
            os._exit(1)  # a broken GPU does not say goodbye to its peers
        flag = torch.tensor([1.0 if os.path.exists(args.done) else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=steps)
        if flag.item() > 0:
            break
        time.sleep(STEP)
    dist.destroy_process_group()
    say(f"done {rank} {node}")


if __name__ == "__main__":
    main()
