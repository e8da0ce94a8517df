"""A worker that floods the deadline FIFO with valid requests from deep in its tree.

    python deadline_flood.py FIFO DEPTH

Forks a chain DEPTH processes deep (each parent waits for its child); the last one posts
valid requests naming itself (a far deadline, renewed), as fast as the FIFO takes them.
It prints ``flooding PID`` once its first 64 KiB are written, and floods until killed
(kill the process group: the chain was started in a session of its own). With FIFO
``-`` the last one prints ``leaf PID`` and waits for stdin to close instead.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def lines(pid: int) -> bytes:
    line = json.dumps({"version": 1, "pid": pid, "scope_id": "flood",
                       "expiration_time": time.time() + 600, "signal": signal.SIGKILL})
    return (line + "\n").encode() * (65536 // (len(line) + 1))


def flood(fifo: str) -> None:
    chunk = lines(os.getpid())
    fd = os.open(fifo, os.O_WRONLY)
    os.write(fd, chunk)
    print(f"flooding {os.getpid()}", flush=True)
    while True:
        os.write(fd, chunk)


def main(fifo: str, depth: int) -> None:
    for _ in range(depth):
        child = os.fork()
        if child:
            os.waitpid(child, 0)
            os._exit(0)
    if fifo == "-":
        print(f"leaf {os.getpid()}", flush=True)
        sys.stdin.read()
    else:
        flood(fifo)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
