"""Records what a worker's interpreter looks like from inside, for the fork-server tests.

    fork_probe.py OUT_DIR [args...]

Writes ``OUT_DIR/<PROBE_TAG>_<LOCAL_RANK>.json`` (tag: ``PROBE_TAG``, else ``r`` and the
restart count) with what a cold start and a standby forked by the fork server must agree
on (or, for the random state, must not), then exits with ``PROBE_EXIT`` (default 0; under
a supervisor, 1 on restart 0 once the file ``PROBE_GATE`` exists, if set). With
``SHADOW=NAME`` it imports NAME and records the file it came from.
"""

import sys

_MODULES_AT_START = sorted(sys.modules)  # before this script imported anything

import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import uuid  # noqa: E402


def random_state() -> dict[str, object]:
    state: dict[str, object] = {"random": random.random(), "uuid4": str(uuid.uuid4()),
                                "hash": hash("abc")}
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch_seed"] = torch.initial_seed()
        state["torch_rand"] = torch.rand(1).item()
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        state["numpy_rand"] = float(np_random.rand())
    return state


def describe() -> dict[str, object]:
    shadow = os.environ.get("SHADOW")
    shadow_file = getattr(__import__(shadow), "__file__", None) if shadow else None
    return {
        "argv": sys.argv,
        "path": sys.path,
        "flags": list(sys.flags),
        "env": dict(os.environ),
        "fds": sorted(int(n) for n in os.listdir("/proc/self/fd")),
        "ppid": os.getppid(),
        "own_session": os.getpgrp() == os.getpid() == os.getsid(0),
        "signals": {s.name: str(signal.getsignal(s)) for s in signal.valid_signals()
                    if isinstance(s, signal.Signals) and s not in (signal.SIGKILL, signal.SIGSTOP)},
        "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "policy": os.sched_getscheduler(0),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "affinity": sorted(os.sched_getaffinity(0)),
        "threads": len(os.listdir("/proc/self/task")),
        "main_keys": sorted(vars(sys.modules["__main__"])),
        "modules_at_start": _MODULES_AT_START,
        "shadow_file": shadow_file,
        "random": random_state(),
    }


if __name__ == "__main__":
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    tag = os.environ.get("PROBE_TAG") or f"r{restart}"
    out = os.path.join(sys.argv[1], f"{tag}_{os.environ['LOCAL_RANK']}.json")
    data = describe()
    with open(out + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(out + ".tmp", out)
    gate = os.environ.get("PROBE_GATE")
    if gate and restart == "0":  # the test says when the first attempt may fail
        import time

        deadline = time.monotonic() + 60
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.01)
        sys.exit(1)
    sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
