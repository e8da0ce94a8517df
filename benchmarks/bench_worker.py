import time; T0 = time.monotonic()  # noqa: E702, I001  -- the very first line: "running"
"""The worker of the side-by-side benchmarks (run by elastic-supervisor and by torchrun).

    bench_worker.py MODE OUT_DIR [CRASHES]

The first line records ``time.monotonic()`` (CLOCK_MONOTONIC is system-wide on Linux, so
it compares across processes); the record is written as ``OUT_DIR/up_R_K`` (restart count
R, local rank K) containing ``T0 PID``, atomically (write then rename), so a reader never
sees half a file. Modes:

- ``exit``:  record and exit 0 (launch latency).
- ``idle``:  record and sleep until killed (RSS and idle CPU).
- ``crash``: on restart counts below CRASHES, rank 0 waits until every rank of its attempt
  is up, waits a random 20-120 ms (so a polling agent is caught at a random phase of its
  interval), writes ``OUT_DIR/crash_R`` with the monotonic time and exits 1 at once; the
  other ranks sleep until the launcher stops them. The first crash comes 0.3 s later (the
  harness reads the launcher's CPU time before it). On restart count CRASHES every rank
  exits 0 after 1 s (the harness reads the launcher's CPU time again), so the job succeeds.

Only the standard library is imported, after the first line, so the recorded time is the
interpreter's start-up plus nothing of ours.
"""

import os  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402

WAIT_ALL_UP = 30.0  # seconds rank 0 waits for its siblings before giving up
FIRST_CRASH_DELAY = 0.3  # s, extra wait before the first crash
FINAL_HOLD = 1.0  # s, the last attempt's workers live this long


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, path)


def _sleep_forever() -> None:
    while True:
        time.sleep(3600)


def _crash_when_all_up(out_dir: str, restart: int, world: int) -> None:
    deadline = time.monotonic() + WAIT_ALL_UP
    wanted = [os.path.join(out_dir, f"up_{restart}_{k}") for k in range(world)]
    while not all(os.path.exists(p) for p in wanted):
        if time.monotonic() > deadline:
            os._exit(3)  # siblings never came up: fail loudly (the harness checks)
        time.sleep(0.002)
    time.sleep(random.uniform(0.02, 0.12) + (FIRST_CRASH_DELAY if restart == 0 else 0.0))
    path = os.path.join(out_dir, f"crash_{restart}")
    fd = os.open(f"{path}.tmp", os.O_WRONLY | os.O_CREAT, 0o644)
    now = time.monotonic()
    os.write(fd, repr(now).encode())
    os.close(fd)
    os.rename(f"{path}.tmp", path)
    os._exit(1)


def main() -> None:
    mode, out_dir = sys.argv[1], sys.argv[2]
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    _write_atomic(os.path.join(out_dir, f"up_{restart}_{rank}"), f"{T0!r} {os.getpid()}\n")
    if mode == "exit":
        return
    if mode == "idle":
        _sleep_forever()
    crashes = int(sys.argv[3])
    if restart >= crashes:
        time.sleep(FINAL_HOLD)
        return
    if rank == 0:
        _crash_when_all_up(out_dir, restart, world)
    _sleep_forever()


if __name__ == "__main__":
    main()
