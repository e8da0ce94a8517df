"""A worker for goodput and readiness tests: posts progress, logs its own timestamps.

Each rank sleeps ``--startup`` seconds (its "import torch"), then posts a deadline every
``--interval`` seconds, ``--steps`` times, and exits 0. Every post and a crash are logged
to ``--log`` as JSON lines ``{"rank", "attempt", "event", "t"}`` with ``t`` taken right
before the act (wall clock), so a test can check the supervisor's accounting against
the workers' own view. ``--fail-rank`` fails after ``--posts`` posts while
TORCHELASTIC_RESTART_COUNT < ``--fail-attempts``: ``--mode exit`` exits 3, ``--mode hang``
stops posting (its last deadline, ``--deadline`` s, then expires); a comma-separated list
(``exit,hang``) gives each failing attempt its own mode.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

from supervisor.worker import TimerClient


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--log", required=True)
    p.add_argument("--startup", type=float, default=0.0)
    p.add_argument("--interval", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--deadline", type=float, default=30.0)
    p.add_argument("--fail-rank", type=int, default=None)
    p.add_argument("--fail-attempts", type=int, default=1)
    p.add_argument("--posts", type=int, default=3)
    p.add_argument("--mode", default="exit", help="exit or hang, or a list: exit,hang")
    p.add_argument("--hold", action="store_true", help="after the steps, wait forever")
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    log_fd = os.open(args.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def record(event: str, t: float) -> None:
        line = json.dumps({"rank": rank, "attempt": attempt, "event": event, "t": t})
        os.write(log_fd, (line + "\n").encode())  # one write: lines never interleave

    client = TimerClient(os.environ["TORCHELASTIC_TIMER_FILE"])
    failing = rank == args.fail_rank and attempt < args.fail_attempts
    modes = args.mode.split(",")
    mode = modes[min(attempt, len(modes) - 1)]
    time.sleep(args.startup)
    for step in range(args.steps):
        t = time.time()
        client.acquire("step", t + args.deadline, signal.SIGKILL)
        record("post", t)
        if failing and step + 1 >= args.posts:
            if mode == "exit":
                record("exit", time.time())
                os._exit(3)
            while True:  # hung: no more posts; the deadline kills us
                time.sleep(3600)
        time.sleep(args.interval)
    client.release("step")
    while args.hold:
        time.sleep(3600)


if __name__ == "__main__":
    main()
