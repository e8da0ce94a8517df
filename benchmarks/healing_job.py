"""The healing benchmark's job: a gloo all-reduce each step, a step every 50 ms.

Every rank appends JSON lines to ``--record-to`` (one write each): ``first`` after its first
step of an attempt, ``step`` every ``--every`` steps, ``failing`` when it exits on purpose;
each with wall time ``t``, ``rank``, ``node`` ($HEAL_NODE), ``port`` (MASTER_PORT: one per
round). A rank on a bad node ($HEAL_BAD=1) exits 1 at its next step once ``--bad-gate``
exists, and at its first step on every later attempt.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist

STEP = 0.05


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--record-to", required=True)
    p.add_argument("--bad-gate", required=True)
    p.add_argument("--every", type=int, default=10)
    args = p.parse_args()
    fd = os.open(args.record_to, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    node = os.environ.get("HEAL_NODE", "?")
    bad = os.environ.get("HEAL_BAD") == "1"

    def record(event: str, **extra: object) -> None:
        doc = {"event": event, "t": time.time(), "rank": int(os.environ["RANK"]), "node": node,
               "port": os.environ["MASTER_PORT"], **extra}
        os.write(fd, (json.dumps(doc) + "\n").encode())

    dist.init_process_group("gloo")
    steps = dist.new_group(timeout=datetime.timedelta(seconds=5))
    turned = os.path.exists(args.bad_gate)  # a later attempt: bad from its first step
    n = 0
    while True:
        if bad and (turned or os.path.exists(args.bad_gate)):
            record("failing")
            os._exit(1)
        x = torch.ones(16)
        dist.all_reduce(x, group=steps)
        n += 1
        if n == 1:
            record("first", world=dist.get_world_size())
        elif n % args.every == 0:
            record("step", n=n)
        time.sleep(STEP)


if __name__ == "__main__":
    main()
