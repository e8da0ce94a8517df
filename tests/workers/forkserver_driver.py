"""Plays the supervisor's part for the fork-server tests, in a process of its own (it
becomes a child subreaper, which the test process must not).

    forkserver_driver.py CONFIG_JSON

CONFIG: ``argv`` (the worker's command), ``ranks``, ``env`` (the node's), ``cwd``,
``preload``, ``watch``, ``cold`` (spawn each rank cold instead), ``per_rank`` (extra
variables of rank N: ``{"N": {...}}``), ``per_attempt`` (applied at the hand-off),
``cpus`` (CPUs of rank N: ``{"N": [...]}``).
Prints one JSON line per event: ``{"ready": report}``, ``{"rank": N, "pid": P, "exit":
CODE}``, and ``{"driver": PID, "server": PID}``.
"""

import json
import os
import select
import sys

from supervisor.core.envs import interpreter
from supervisor.workers.guardian import set_child_subreaper
from supervisor.workers.spawn import DeathSignal, WorkerSpec, spawn_worker
from supervisor.workers.warm.forkserver import (
    ForkServer,
    ForkServerConfig,
    Wanted,
    cold_path0,
)
from supervisor.workers.warm.standby import SETUP_WAIT, Standby


def say(**what: object) -> None:
    print(json.dumps(what), flush=True)


def rank_env(config: dict, rank: int) -> dict[str, str]:
    env = {**config["env"], "LOCAL_RANK": str(rank)}
    env.update(config.get("per_rank", {}).get(str(rank), {}))
    return env


def main() -> int:
    config = json.loads(sys.argv[1])
    set_child_subreaper()
    death = DeathSignal()
    prefix = interpreter(sys.executable)
    argv = [*prefix, *config["argv"]]
    per_attempt = config.get("per_attempt", {})
    if config.get("cold"):
        for rank in range(config["ranks"]):
            spec = WorkerSpec(rank, rank, argv, {**rank_env(config, rank), **per_attempt},
                              cwd=config.get("cwd"))
            worker = spawn_worker(spec, death)
            worker.reap()
            say(rank=rank, pid=worker.pid, exit=worker.popen.wait())
        return 0
    server_config = ForkServerConfig(
        python=sys.executable, env=config["env"], cwd=config.get("cwd"),
        path0=cold_path0(config["argv"], config.get("cwd"), config["env"]),
        preload=tuple(config.get("preload", ())), watch=tuple(config.get("watch", ())),
        auto_names=tuple(config.get("auto", ())),
    )
    server = ForkServer.start(server_config, death, prefix)
    say(driver=os.getpid(), server=server.pid)
    report = server.wait_ready(120)
    say(ready={"ok": report.ok, "error": report.error, "tainted": report.tainted,
               "threaded": report.threaded, "skipped": report.skipped})
    if not report.ok:
        server.stop()
        return 0
    envs = [rank_env(config, rank) for rank in range(config["ranks"])]
    cpus = {int(rank): tuple(c) for rank, c in config.get("cpus", {}).items()}
    batch = server.fork([Wanted(rank, env, cpus.get(rank)) for rank, env in enumerate(envs)])
    forked = []
    for (rank, env), one in zip(enumerate(envs), batch, strict=True):
        assert one is not None, f"rank {rank} was not forked"
        forked.append((rank, env, one))
    if config.get("stop_server_first"):
        server.stop()
    for rank, env, standby_of in forked:
        standby = Standby(standby_of.process, standby_of.sock, prefix, env, forked=True)
        spec = WorkerSpec(rank, rank, argv, {**env, **per_attempt}, stdout=1, stderr=2,
                          cwd=config.get("cwd"))
        # as the pool's ready(): the set-up report may take up to SETUP_WAIT s to come
        select.select([standby_of.sock], [], [], SETUP_WAIT)
        worker = standby.go(spec, per_attempt)
        if worker is None:
            say(rank=rank, pid=standby_of.process.pid, exit=None)
            continue
        worker.reap()
        say(rank=rank, pid=worker.pid, exit=worker.popen.wait())
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
