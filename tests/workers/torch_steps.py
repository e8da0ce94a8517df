"""A real torch job without deadline posts, for the progress-rule tests.

    torch_steps.py LOG [--steps N] [--crash-rank R]

Prints ``rank R starting`` at once (as training scripts do, before anything trains),
imports torch, joins a gloo group, then runs N all-reduce steps printing
``step K loss X`` to stdout. Rank ``--crash-rank`` exits 3 after step 2 of attempt 0.
Logs the wall time of its first step and of its crash to LOG (JSON lines), taken right
before each act.
"""

import json
import os
import sys
import time

LOG = sys.argv[1]
STEPS = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 8
CRASH = int(sys.argv[sys.argv.index("--crash-rank") + 1]) if "--crash-rank" in sys.argv else -1
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])


def say(text: str) -> None:
    """One write per line: ranks share the console, and under ``-u`` print() writes the
    text and its newline apart, so lines of two ranks could interleave."""
    os.write(1, (text + "\n").encode())


def log(event: str, t: float) -> None:
    with open(LOG, "a") as f:
        f.write(json.dumps({"rank": rank, "attempt": attempt, "event": event, "t": t}) + "\n")


say(f"rank {rank} starting")  # not progress: nothing trains yet

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
value = torch.ones(4)
for step in range(STEPS):
    dist.all_reduce(value)
    value /= dist.get_world_size()
    if step == 0:
        log("step", time.time())
    say(f"step {step} loss {float(value.sum()):.3f}")
    if rank == CRASH and attempt == 0 and step == 2:
        log("crash", time.time())
        os._exit(3)
    time.sleep(0.1)
dist.destroy_process_group()
