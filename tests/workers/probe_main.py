"""Records what a worker's interpreter looks like from inside, for the warm-start tests.

    probe_main.py OUT_DIR [raise]

Writes ``OUT_DIR/<restart>_<rank>.json`` (atomically) with everything a cold
``python -u probe_main.py`` and a warm start must agree on, prints ``probed RANK RESTART``,
then exits 1 on restart 0 (so the group restarts) and 0 after. With ``raise`` it raises
instead, from inside a function, so the traceback has frames of its own (and an atexit hook
records ``sys.last_value`` to ``OUT_DIR/<restart>_<rank>.last``). With ``PROBE_GATE=FILE``
in the environment, restart 0 waits for FILE before it exits.
"""

import json
import os
import signal
import stat
import sys
import time

_MODULES_AT_START = sorted(sys.modules)  # before this script imported anything else of its own


def describe() -> dict[str, object]:
    main = sys.modules["__main__"]
    loader = getattr(main, "__loader__", None)
    spec = getattr(main, "__spec__", None)

    def fd_kind(fd: int) -> str:
        mode = os.fstat(fd).st_mode
        return "fifo" if stat.S_ISFIFO(mode) else "chr" if stat.S_ISCHR(mode) else "file"

    return {
        "argv": sys.argv,
        "orig_argv": sys.orig_argv,
        "path0": sys.path[0],
        "path": sys.path[1:],
        "main_keys": sorted(k for k in vars(main) if k.startswith("__")),
        "name": main.__name__,
        "file": getattr(main, "__file__", None),
        "cached": getattr(main, "__cached__", "absent"),
        "package": getattr(main, "__package__", "absent"),
        "doc": main.__doc__,
        "loader": type(loader).__name__ if loader is not None else None,
        "loader_name": getattr(loader, "name", None),
        "loader_path": getattr(loader, "path", None),
        "spec": getattr(spec, "name", None),
        "code_file": sys._getframe(0).f_code.co_filename,
        "stack_depth": len(__import__("traceback").extract_stack()),
        "modules": _MODULES_AT_START,
        "flags": list(sys.flags),
        "executable": sys.executable,
        "cwd": os.getcwd(),
        "stdin": os.readlink("/proc/self/fd/0"),
        "stdin_access": __import__("fcntl").fcntl(0, __import__("fcntl").F_GETFL) & os.O_ACCMODE,
        "stdout": fd_kind(1),
        "stderr": fd_kind(2),
        "write_through": sys.stdout.write_through,
        "own_group": os.getpgrp() == os.getpid() == os.getsid(0),
        "signals": {s.name: str(signal.getsignal(s)) for s in
                    (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGUSR1)},
        "env": dict(os.environ),
        "fds": sorted(int(n) for n in os.listdir("/proc/self/fd")),
        "spawned_child": spawned_child(),
    }


def square(x: int) -> int:
    return x * x


def spawned_child() -> str:
    """What multiprocessing's spawn (torch DataLoader workers use it) makes of our __main__:
    the child re-imports the main script and unpickles a function defined in it."""
    import multiprocessing

    try:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            return repr(pool.apply(square, (7,)))
    except Exception as exc:  # the same failure, cold or warm, is fine too
        return type(exc).__name__


def boom(rank: int) -> None:
    raise ValueError(f"probe failure on rank {rank}")


if __name__ == "__main__":
    out_dir = sys.argv[1]
    rank = int(os.environ["RANK"])
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    path = os.path.join(out_dir, f"{restart}_{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(describe(), f)
    os.replace(path + ".tmp", path)
    print(f"probed {rank} {restart}", flush=True)
    # no rank ends the attempt (and so has its siblings stopped) before all have recorded
    world = int(os.environ["WORLD_SIZE"])
    records = [os.path.join(out_dir, f"{restart}_{r}.json") for r in range(world)]
    deadline = time.monotonic() + 60
    while not all(map(os.path.exists, records)) and time.monotonic() < deadline:
        time.sleep(0.01)
    gate = os.environ.get("PROBE_GATE")  # a file the test creates when the restart may come
    while gate and restart == 0 and not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.01)
    if sys.argv[2:] == ["raise"]:
        import atexit

        def record_last_value() -> None:  # what an atexit hook sees of the uncaught error
            with open(os.path.join(out_dir, f"{restart}_{rank}.last"), "w") as f:
                f.write(repr(getattr(sys, "last_value", None)))

        atexit.register(record_last_value)
        boom(rank)
    sys.exit(1 if restart == 0 else 0)
