"""A worker group's stop while a node check runs: the sweep leaves the check alone.

Run as a process of its own (it becomes a child subreaper, as the supervisor is, and a
group's sweep signals every adopted child of the process). A check (``node_check.py
--hang PIDFILE``) runs; a stop of a group whose workers already exited sweeps our
children with the group's exemptions (``WorkerGroup.exempt``). Prints one JSON line:
whether the check's leader and its grandchild survived the sweep.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from pathlib import Path

import anyio

from supervisor.config import Settings
from supervisor.events import EventLog
from supervisor.workers.group import WorkerGroup
from supervisor.workers.nodecheck import NodeChecker
from supervisor.workers.output import OutputPlan
from supervisor.workers.spawn import DeathSignal
from supervisor.workers.stop import stop_group
from supervisor.workers.warm.base import NullPool


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def main() -> None:
    check, tmp = sys.argv[1], Path(sys.argv[2])
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    settings = Settings(training_script=check, shutdown_timeout=1.0)
    group = WorkerGroup(
        settings, run_id="job", events=EventLog(None, "job"), log_root=tmp / "logs",
        output=OutputPlan.from_settings(settings), environ={}, timer_file=None,
        post=lambda event: None, death=DeathSignal(), pool=NullPool(), sweep_adopted=True)
    pidfile = tmp / "pids"
    checker = NodeChecker([sys.executable, check, "--hang", str(pidfile)], dict(os.environ),
                          60.0, tmp / "logs")
    async with anyio.create_task_group() as tg:
        tg.start_soon(checker.run)
        with anyio.fail_after(20):
            while not pidfile.exists():
                await anyio.sleep(0.02)  # another process writes it: no event to wait on
        leader, grandchild = (int(p) for p in pidfile.read_text().split())
        await stop_group([], signum=signal.SIGTERM, grace=1.0, kill_now=anyio.Event(),
                         sweep_adopted=True, exempt=group.exempt(), kill_wait=1.0)
        report = {"leader_alive": alive(leader), "grandchild_alive": alive(grandchild)}
        tg.cancel_scope.cancel()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    anyio.run(main)
