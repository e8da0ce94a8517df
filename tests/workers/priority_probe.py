"""Prints, as one JSON line, this worker's CPU priority and its supervisor's (the parent).

The supervisor's event loop is its main thread (thread id = pid); its other threads (the
spawner, AnyIO's workers) are listed by id. On attempt ``PROBE_FAIL_ATTEMPT`` (none by default)
rank 0 exits 3 once every rank of it has printed (each leaves a file in ``PROBE_DIR``)
and the file ``PROBE_GO`` names, if any, exists;
every other run exits 0.
"""

import contextlib
import json
import os
import sys
import time


def nice_of(pid: int, tid: int) -> int:
    with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii") as f:
        return int(f.read().rpartition(")")[2].split()[16])  # field 19: nice


def threads(pid: int) -> dict[str, int]:
    """Every thread but the main one -> its nice value (one that ended meanwhile: left out)."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        if int(tid) != pid:
            with contextlib.suppress(OSError):
                found[tid] = nice_of(pid, int(tid))
    return found


def autogroup_nice(pid: int) -> int | None:
    """None: no autogroup (a kernel without them, or the root group's: the file is empty
    for a process whose session is init's, or that sits in a CPU cgroup of its own)."""
    try:
        with open(f"/proc/{pid}/autogroup", encoding="ascii") as f:
            fields = f.read().split()
    except OSError:
        return None
    return int(fields[-1]) if fields else None


parent = os.getppid()
policy = os.sched_getscheduler(0)
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
sys.stdout.write(json.dumps({
    "rank": int(os.environ["RANK"]),
    "attempt": attempt,
    "nice": os.getpriority(os.PRIO_PROCESS, 0),
    "policy": policy & ~os.SCHED_RESET_ON_FORK,
    "reset_on_fork": bool(policy & os.SCHED_RESET_ON_FORK),
    "autogroup": autogroup_nice(os.getpid()),
    "parent": parent,
    "loop_nice": nice_of(parent, parent),
    "other_threads": threads(parent),
    "parent_autogroup": autogroup_nice(parent),
}) + "\n")  # one write: ranks share the pipe
sys.stdout.flush()
if os.environ.get("PROBE_FAIL_ATTEMPT") == str(attempt):
    where = os.environ["PROBE_DIR"]
    open(os.path.join(where, f"{attempt}.{os.environ['RANK']}"), "w").close()
    if os.environ["RANK"] == "0":
        ranks = int(os.environ["WORLD_SIZE"])
        deadline = time.monotonic() + 30
        go = os.environ.get("PROBE_GO")  # a file the test makes when it is time to fail
        while ((len([n for n in os.listdir(where) if n.startswith(f"{attempt}.")]) < ranks
                or (go is not None and not os.path.exists(go)))
               and time.monotonic() < deadline):
            time.sleep(0.01)
        raise SystemExit(3)
    time.sleep(30)  # until the group is stopped
