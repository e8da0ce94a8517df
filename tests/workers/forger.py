"""A worker that speaks to the snapshot socket by hand, as a buggy or hostile one would.

    forger.py OUT [--forge | --save]

Prints ``socket PATH`` (rank 0), then without ``--forge`` waits for ``OUT/go`` (while a
test speaks to the socket as a process that is no worker, or looks at the regions; with
``--save``, rank 0 saves step 1 first and prints ``rank 0 saved True``). With
``--forge``, on its own connection: a message naming the other rank, a malformed line,
a commit nothing reserved, then an honest restore query; prints
``rank R <what> refused: <reason>`` or ``rank R <what> ok``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path


def main() -> int:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    path = os.environ["ELASTIC_SUPERVISOR_SNAPSHOT"]
    if rank == 0:
        print(f"socket {path}", flush=True)
    if "--save" in sys.argv and rank == 0:
        from supervisor import snapshot

        print(f"rank 0 saved {snapshot.save({'step': 1}, 1)}", flush=True)
    if "--forge" not in sys.argv:
        deadline = time.monotonic() + 60
        while not (out / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.02)  # a worker's own pace: the test waits on its output, not this
        return 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        replies = sock.makefile("rb")

        def ask(what: str, line: bytes) -> None:
            sock.sendall(line + b"\n")
            reply = json.loads(replies.readline())
            verdict = "ok" if reply.get("ok") else f"refused: {reply.get('reason')}"
            print(f"rank {rank} {what} {verdict}", flush=True)

        other = 1 - rank
        ask("forged", json.dumps({"op": "restore", "rank": other}).encode())
        ask("malformed", b'{"op": "commit", "rank": 0')
        ask("bogus commit", json.dumps({"op": "commit", "rank": rank, "step": 9, "slot": 0,
                                        "size": 10, "checksum": 0}).encode())
        ask("own restore", json.dumps({"op": "restore", "rank": rank}).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
