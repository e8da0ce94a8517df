"""A worker for the healing tests: a node turns bad, or a rank carries a bug.

It prints ``ready RANK NODE`` once started (``NODE`` is $HEAL_NODE, set per supervisor).
A worker on a bad node ($HEAL_BAD=1) exits 1 once the file ``--bad-gate`` exists (at once
on every later attempt); ``--fail-rank R`` makes global rank R exit 1 the same way on any
node (a bug that follows the rank). Every other worker exits 0 once ``--done`` exists.
"""

from __future__ import annotations

import argparse
import os
import time

POLL = 0.02  # s: how often the files are looked at (the worker's own pace, not a test's)


def say(text: str) -> None:
    os.write(1, (text + "\n").encode())


def wait_for(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(POLL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bad-gate", required=True)
    p.add_argument("--done", required=True)
    p.add_argument("--fail-rank", type=int, default=None)
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    node = os.environ.get("HEAL_NODE", "?")
    say(f"ready {rank} {node} world {os.environ['WORLD_SIZE']} port {os.environ['MASTER_PORT']}")
    bad = os.environ.get("HEAL_BAD") == "1" or rank == args.fail_rank
    if bad:
        wait_for(args.bad_gate)
        say(f"failing {rank} {node}")
        raise SystemExit(1)
    wait_for(args.done)
    say(f"done {rank} {node}")


if __name__ == "__main__":
    main()
