"""Run one node check inside a pid namespace and steer its leader's pid to a decoy.

Run as pid 1 of a new pid namespace (``unshare --pid --fork --mount-proc``): orphans come
to us, as to a supervisor (a child subreaper), and ``ns_last_pid`` is ours to write.

The check (``node_check.py --setsid-helper``) passes at once but leaves a helper in a
session of its own holding its stdout. As soon as the check's leader is reaped, its pid is
handed to a decoy: a session leader of its own (``ns_last_pid`` = leader - 1). Regression
(issue 52, finding 3): the leader was reaped at its exit, the check waited for EOF until
its timeout and then ``killpg(leader)`` killed the decoy. Prints one JSON line: the
check's result, whether the decoy got the pid and lives, whether the helper lives.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import anyio

from supervisor.workers.nodecheck import NodeChecker

STEER_TRIES = 50


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def survives(process: subprocess.Popen[bytes], within: float = 3.0) -> bool:
    """Whether ``process`` is still alive ``within`` seconds from now: a SIGKILL sent to it
    before this call ends it in milliseconds; its pidfd turns readable at its exit."""
    fd = os.pidfd_open(process.pid)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return not poller.poll(int(within * 1000))
    finally:
        os.close(fd)


def decoy_at(pid: int) -> subprocess.Popen[bytes] | None:
    """A session leader with ``pid``, or None if the pid could not be steered to it."""
    for _ in range(STEER_TRIES):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        decoy = subprocess.Popen(["sleep", "600"], start_new_session=True)
        if decoy.pid == pid:
            return decoy
        decoy.kill()
        decoy.wait()
    return None


async def steer(pidfile: Path, found: dict[str, object]) -> None:
    """Once the leader is reaped, give its pid to a decoy."""
    while not pidfile.exists():
        await anyio.sleep(0.01)  # polling a file another process writes: no event for it
    leader, helper = (int(p) for p in pidfile.read_text().split())
    found.update(leader=leader, helper=helper)
    while os.path.exists(f"/proc/{leader}"):  # a zombie keeps its /proc entry: not reaped
        await anyio.sleep(0.01)
    decoy = decoy_at(leader)
    found["decoy"] = decoy


async def main() -> None:
    check, pidfile, timeout = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
    checker = NodeChecker([sys.executable, check, "--setsid-helper", str(pidfile)],
                          dict(os.environ), timeout, pidfile.parent / "logs")
    found: dict[str, object] = {}
    async with anyio.create_task_group() as tg:
        tg.start_soon(steer, pidfile, found)
        started = time.monotonic()
        result = await checker.run()
        took = time.monotonic() - started
        with anyio.fail_after(10):
            while "decoy" not in found:
                await anyio.sleep(0.01)
    decoy = found["decoy"]
    assert decoy is None or isinstance(decoy, subprocess.Popen)
    report = {
        "ok": result.ok, "reason": result.reason, "seconds": took,
        "decoy_steered": decoy is not None,
        "decoy_alive": decoy is not None and survives(decoy),
        "helper_alive": alive(int(str(found["helper"]))),
    }
    print(json.dumps(report), flush=True)
    if decoy is not None:
        decoy.kill()
        decoy.wait()


if __name__ == "__main__":
    anyio.run(main)
