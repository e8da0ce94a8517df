"""Every attempt under ``--preload`` runs in standbys forked from the node's fork server,
and a fork server that dies means cold starts and a new server, never a failed job."""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request
from pathlib import Path
from typing import Any

import anyio

from tests.support.daemon import supervisor
from tests.support.eventlog import read_events, warm_ranks
from tests.support.paths import FAKE_WORKER, WORKERS
from tests.support.processes import pid_alive

PROBE = str(WORKERS / "probe_main.py")
BASE = ["--health-port", "0", "--shutdown-timeout", "5", "--log-level", "debug"]


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


async def metrics_of(text: str) -> str:
    found = re.search(r"health endpoint on http://[^:]+:(\d+)", text)
    assert found is not None
    return await anyio.to_thread.run_sync(get, f"http://127.0.0.1:{found.group(1)}/metrics")


async def test_every_attempt_runs_in_a_standby_forked_from_the_fork_server(
        tmp_path: Path) -> None:
    """Compared with a cold run of the same job (same output directory) without
    ``--preload``."""
    out = tmp_path / "out"
    out.mkdir()
    logs = tmp_path / "logs"
    gate = tmp_path / "gate"
    job = [*BASE, "--nproc-per-node", "2", "--max-restarts", "1"]
    gate.touch()
    async with supervisor([*job, "--log-dir", str(tmp_path / "cold_logs"), PROBE,
                           str(out)], env={"PROBE_GATE": str(gate)}) as sup:
        assert await sup.wait() == 0
    colds = [json.loads((out / f"0_{rank}.json").read_text()) for rank in range(2)]
    for record in out.iterdir():
        record.unlink()
    gate.unlink()
    args = [*job, "--log-dir", str(logs), "--preload", "colorsys,xml.dom.minidom", PROBE,
            str(out)]
    async with supervisor(args, env={"PROBE_GATE": str(gate)}) as sup:
        server = int((await sup.err.expect(r"fork server \(pid (\d+)\) ready")).group(1))
        for _ in range(4):  # the first attempt's standbys, then the restart's
            await sup.err.expect(rf"standby for local rank \d forked as pid \d+ by the fork "
                                 rf"server \(pid {server}\)")
        gate.touch()  # now restart 0 may fail
        assert await sup.wait() == 0
    # started while the rendezvous formed, for the command the launch then ran: one server
    assert sup.err.text().count("ready: preloaded") == 1
    assert warm_ranks(logs) == [[0, 1], [0, 1]]
    for rank, cold in enumerate(colds):
        assert "xml.dom.minidom" not in cold["modules"]
        for restart in range(2):
            warm = json.loads((out / f"{restart}_{rank}.json").read_text())
            assert "xml.dom.minidom" in warm["modules"]
            for key in ("argv", "path0", "path", "main_keys", "stdin", "stdout", "stderr",
                        "own_group", "signals", "spawned_child"):
                assert warm[key] == cold[key], key


def one_standby_job(logs: Path) -> list[str]:
    """One rank that hangs until SIGUSR1 (then exits 1 in attempt 0), a fork server."""
    return [*BASE, "--max-restarts", "2", "--log-dir", str(logs), "--preload",
            "xml.dom.minidom", FAKE_WORKER, "--hang", "--usr1-exit", "1", "--fail-attempts", "1"]


async def standby_forked(sup: Any) -> tuple[int, int]:
    """(rank 0's pid, the fork server's pid) once the next attempt's standby is forked."""
    pid = int((await sup.out.expect(r"^ready 0 (\d+) 0$")).group(1))
    server = int((await sup.err.expect(r"fork server \(pid (\d+)\) ready")).group(1))
    for _ in range(2):  # the first attempt's, then the next one's
        await sup.err.expect(r"standby for local rank 0 forked as pid \d+")
    return pid, server


async def test_a_dead_fork_server_means_cold_starts_and_a_new_server(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    async with supervisor(one_standby_job(logs)) as sup:
        pid, server = await standby_forked(sup)
        os.kill(server, signal.SIGKILL)  # its standby lives on: the restart is warm
        os.kill(pid, signal.SIGUSR1)
        await sup.out.expect(r"^ready 0 \d+ 1$")
        await sup.err.expect(rf"fork server \(pid {server}\) died: killed by signal 9: "
                             r"ranks without a standby start cold")
        await sup.err.expect(rf"fork server \(pid (?!{server}\))\d+\) ready")
        text = await metrics_of(sup.err.text())
        assert re.search(r'fork_server_failures_total\{reason="died"\} 1\.0', text), text
        sup.signal(signal.SIGTERM)
        assert await sup.wait() == 128 + signal.SIGTERM  # not a job failure
    assert warm_ranks(logs) == [[0], [0]]
    restarts = read_events(logs / "none" / "events.jsonl", "group_started")
    assert len(restarts) == 2  # the server's death used none of the restart budget


async def test_a_server_found_unusable_at_a_fork_is_replaced_at_once(tmp_path: Path) -> None:
    """A server that stopped answering (frozen here; one killed since its last fork is
    found the same way) fails the fork of the next attempt's standbys: a replacement is
    started then, and forks them, instead of at the next launch (which would start cold
    too)."""
    logs = tmp_path / "logs"
    async with supervisor(one_standby_job(logs)) as sup:
        pid, server = await standby_forked(sup)
        os.kill(server, signal.SIGSTOP)  # alive, but it forks no more
        os.kill(pid, signal.SIGUSR1)
        await sup.out.expect(r"^ready 0 \d+ 1$")  # attempt 1 in the standby forked before
        await sup.err.expect(rf"fork server \(pid {server}\): .*ranks without a standby start "
                             r"cold", timeout=30)
        new = int((await sup.err.expect(rf"fork server \(pid (?!{server}\))(\d+)\) ready"))
                  .group(1))
        await sup.err.expect(rf"standby for local rank 0 forked as pid \d+ by the fork server "
                             rf"\(pid {new}\)")
        text = await metrics_of(sup.err.text())
        assert re.search(r'fork_server_failures_total\{reason="fork"\} 1\.0', text), text
        sup.signal(signal.SIGTERM)
        assert await sup.wait() == 128 + signal.SIGTERM  # not a job failure
    assert not pid_alive(server)
    restarts = read_events(logs / "none" / "events.jsonl", "group_started")
    assert len(restarts) == 2  # the server's failure used none of the restart budget


async def test_auto_starts_with_what_an_earlier_run_kept(tmp_path: Path) -> None:
    """The list an earlier run with this log directory and run id kept (here written as
    that run would have left it) is imported while the rendezvous forms: the first
    attempt already starts with it."""
    out = tmp_path / "out"
    out.mkdir()
    logs = tmp_path / "logs"
    (logs / "none").mkdir(parents=True, mode=0o700)
    (logs / "none" / "preload-auto.json").write_text(
        json.dumps({"names": ["psutil", "iniconfig"], "exclude": []}))
    args = [*BASE, "--max-restarts", "2", "--log-dir", str(logs), "--preload", "auto",
            str(WORKERS / "auto_refine_job.py"), str(out)]
    async with supervisor(args) as sup:
        await sup.err.expect(r"fork server \(pid \d+\) ready: preloaded auto", timeout=60)
        await sup.err.expect(r"standby for local rank 0 forked as pid", timeout=30)
        (out / "go1").touch()
        (out / "go0").touch()
        assert await sup.wait() == 0
    assert warm_ranks(logs)[:2] == [[0], [0]]
    first = json.loads((out / "r0_0.json").read_text())["modules_at_start"]
    assert "psutil" in first and "iniconfig" in first


async def test_auto_forks_the_first_attempt_and_learns_everything_for_the_first_restart(
        tmp_path: Path) -> None:
    """``--preload auto`` on a node that learned nothing yet: the first attempt runs in
    interpreters forked from a server with nothing preloaded, so its workers record what
    they import, and the first restart already has the pure-Python module (iniconfig; DDP's
    ``torch._dynamo`` in a torch job) that a cold worker's mapped libraries cannot show."""
    out = tmp_path / "out"
    out.mkdir()
    logs = tmp_path / "logs"
    args = [*BASE, "--max-restarts", "2", "--log-dir", str(logs), "--preload", "auto",
            str(WORKERS / "auto_refine_job.py"), str(out)]
    async with supervisor(args) as sup:
        await sup.err.expect(r"fork server \(pid \d+\) ready: preloaded nothing", timeout=60)
        await sup.err.expect(r"fork server \(pid \d+\) ready: preloaded auto", timeout=60)
        for attempt in range(2):
            await sup.err.expect(r"standby for local rank 0 forked as pid", timeout=30)
            (out / f"go{attempt}").touch()
        assert await sup.wait() == 0
    assert warm_ranks(logs) == [[0], [0], [0]]
    first = json.loads((out / "r1_0.json").read_text())["modules_at_start"]
    assert "psutil" in first and "iniconfig" in first
    kept = json.loads((logs / "none" / "preload-auto.json").read_text())
    assert {"psutil", "iniconfig"} <= set(kept["names"])  # for the next run


async def test_auto_learns_once_per_node_and_a_second_server_preloads_it(
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    logs = tmp_path / "logs"
    gate = tmp_path / "gate"
    probe = str(WORKERS / "fork_probe.py")
    args = [*BASE, "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", str(logs),
            "--preload", "auto", probe, str(out)]
    # the first attempt's workers (forked from a server with nothing) import psutil
    env = {"SHADOW": "psutil", "PROBE_GATE": str(gate)}
    async with supervisor(args, env=env) as sup:
        await sup.err.expect(r"fork server \(pid \d+\) ready: preloaded auto", timeout=60)
        for _ in range(2):
            await sup.err.expect(r"standby for local rank \d forked as pid", timeout=30)
        gate.touch()
        assert await sup.wait() == 0
    assert sup.err.text().count("ready: preloaded auto") == 1  # learned once, one server
    assert warm_ranks(logs) == [[0, 1], [0, 1]]
    for rank in range(2):
        first = json.loads((out / f"r0_{rank}.json").read_text())
        second = json.loads((out / f"r1_{rank}.json").read_text())
        assert "psutil" not in first["modules_at_start"]
        assert "psutil" in second["modules_at_start"]
