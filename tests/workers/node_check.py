"""A node check for the tests: healthy unless told otherwise by files or flags.

``--sick-dir D``: unhealthy (exit 1, first line names the node) while ``D/sick-<node>``
exists, <node> being $ELASTIC_SUPERVISOR_NODE_ID. ``--hang PIDFILE``: start a grandchild in
the same process group, write both pids to PIDFILE, then sleep forever. ``--flood N``:
print N bytes of output, then exit 1. ``--sleep S``: take S seconds first.
``--setsid-helper PIDFILE``: start a helper in a session of its own that keeps stdout open,
write "CHECK HELPER" pids to PIDFILE, then pass (exit 0) while the helper sleeps on.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sick-dir", default=None)
    p.add_argument("--hang", default=None)
    p.add_argument("--flood", type=int, default=0)
    p.add_argument("--setsid-helper", default=None)
    p.add_argument("--sleep", type=float, default=0.0, help="take this long (a slow check)")
    args = p.parse_args()
    time.sleep(args.sleep)
    node = os.environ.get("ELASTIC_SUPERVISOR_NODE_ID", "?")
    if args.setsid_helper:
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"],
                                  start_new_session=True)  # inherits stdout: holds the pipe
        with open(args.setsid_helper + ".tmp", "w") as f:
            f.write(f"{os.getpid()} {helper.pid}\n")
        os.replace(args.setsid_helper + ".tmp", args.setsid_helper)
    if args.hang:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        with open(args.hang + ".tmp", "w") as f:
            f.write(f"{os.getpid()} {child.pid}\n")
        os.replace(args.hang + ".tmp", args.hang)
        time.sleep(3600)
    if args.flood:
        line = b"flooding the console with output that nobody reads\n"
        out = sys.stdout.buffer
        for _ in range(args.flood // len(line) + 1):
            out.write(line)
        out.flush()
        raise SystemExit(1)
    if args.sick_dir and os.path.exists(os.path.join(args.sick_dir, f"sick-{node}")):
        print(f"\nGPU 0 on {node}: XID 79 (fallen off the bus)\nmore details", flush=True)
        raise SystemExit(1)
    print(f"healthy {node} run {os.environ.get('ELASTIC_SUPERVISOR_RUN_ID')}")


if __name__ == "__main__":
    main()
