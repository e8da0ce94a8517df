"""The node check: the runner with real processes, and real daemons that run it."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import aiohttp
import pytest

from supervisor.core.nodehealth import EXIT_QUARANTINED
from supervisor.workers.nodecheck import OUTPUT_LIMIT, NodeCheckConfigError, NodeChecker
from tests.support.daemon import supervisor
from tests.support.etcd import EtcdMember
from tests.support.healing import exit_code, group_without, healing_job
from tests.support.paths import FAKE_WORKER, TESTS
from tests.support.processes import pid_alive, wait_dead

CHECK = str(TESTS / "workers" / "node_check.py")


def checker(tmp_path: Path, *args: str, timeout: float = 30.0,
            node: str = "n0") -> NodeChecker:
    env = {**os.environ, "ELASTIC_SUPERVISOR_NODE_ID": node}
    return NodeChecker([sys.executable, CHECK, *args], env, timeout, tmp_path / "logs")


def check_flag(*args: str) -> str:
    return " ".join([sys.executable, CHECK, *args])


async def test_a_passing_check_is_healthy(tmp_path: Path) -> None:
    result = await checker(tmp_path).run()
    assert result.ok and result.reason == "" and result.exit_code == 0


async def test_the_reason_is_the_first_non_empty_line_of_the_output(tmp_path: Path) -> None:
    (tmp_path / "sick-n0").touch()
    result = await checker(tmp_path, "--sick-dir", str(tmp_path)).run()
    assert not result.ok
    assert result.reason == ("node check exited with code 1: GPU 0 on n0: XID 79 (fallen "
                             "off the bus)")


async def test_a_hanging_check_is_killed_with_its_process_group_on_timeout(
    tmp_path: Path
) -> None:
    pidfile = tmp_path / "pids"
    result = await checker(tmp_path, "--hang", str(pidfile), timeout=2.0).run()
    assert not result.ok and result.timed_out
    assert result.reason == "node check timed out after 2 s"
    pids = [int(p) for p in pidfile.read_text().split()]
    await wait_dead(pids, timeout=5)  # the check and the grandchild it started
    assert not any(pid_alive(p) for p in pids)


async def test_a_check_that_prints_a_megabyte_is_bounded(tmp_path: Path) -> None:
    check = checker(tmp_path, "--flood", str(1 << 20))
    result = await check.run()
    assert not result.ok and not result.timed_out and result.exit_code == 1
    assert result.reason == ("node check exited with code 1: flooding the console with "
                             "output that nobody reads")
    assert OUTPUT_LIMIT < 1 << 20


async def test_a_check_that_does_not_exist_is_a_setting_error(tmp_path: Path) -> None:
    missing = NodeChecker([str(tmp_path / "no-such-check")], {}, 5.0, tmp_path)
    with pytest.raises(NodeCheckConfigError, match="exited with 127 \\(not found\\)"):
        await missing.run()


async def test_an_unusable_log_directory_fails_the_built_in_check(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    result = await NodeChecker([], {}, 5.0, tmp_path / "file" / "logs").run()
    assert not result.ok and "is not writable" in result.reason


async def test_a_missing_node_check_exits_2_with_one_line(tmp_path: Path) -> None:
    args = ["--node-check", str(tmp_path / "no-such-check"), "--log-dir", str(tmp_path),
            "--no-health", FAKE_WORKER]
    async with supervisor(args) as sup:
        assert await sup.wait() == 2
    lines = [line for line in sup.err.lines if line.strip()]
    assert lines == [f"elastic-supervisor: config error: node_check: command not found or not "
                     f"executable: {str(tmp_path / 'no-such-check')!r}"]


async def test_static_a_failing_check_fails_the_launch_with_the_quarantine_code(
    tmp_path: Path
) -> None:
    (tmp_path / f"sick-{socket.gethostname()}").touch()
    args = ["--node-check", check_flag("--sick-dir", str(tmp_path)), "--log-dir",
            str(tmp_path / "logs"), "--no-health", FAKE_WORKER]
    async with supervisor(args) as sup:
        assert await sup.wait() == EXIT_QUARANTINED
    assert "node quarantined: node check exited with code 1: GPU 0 on" in sup.err.text()
    assert "worker group" not in sup.err.text()  # nothing was started


# ------------------------------------------------------------------------ with etcd



async def get(url: str) -> tuple[int, dict[str, object]]:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return resp.status, await resp.json(content_type=None)


@pytest.mark.etcd
async def test_a_node_failing_its_check_does_not_join_until_it_passes(
    tmp_path: Path, server: EtcdMember
) -> None:
    sick = tmp_path / "sick-n0"
    sick.touch()
    flags = ["--node-check", check_flag("--sick-dir", str(tmp_path)), "--node-check-retry",
             "0.2"]
    async with healing_job(tmp_path, server.endpoint, nnodes="1:1", flags=flags) as job:
        job.done.touch()
        node = await job.start("n0")
        port = await node.sup.health_port()
        await node.sup.err.expect("node check failed, not joining; again in 0.2 s: node "
                                  "check exited with code 1: GPU 0 on n0")
        await node.sup.err.expect("health server listening")
        assert (await get(f"http://127.0.0.1:{port}/status"))[0] == 200
        doc = (await get(f"http://127.0.0.1:{port}/status"))[1]
        health = doc["node_health"]
        assert isinstance(health, dict) and health["state"] in ("unhealthy", "checking")
        assert "XID 79" in str(health["reason"])
        assert (await get(f"http://127.0.0.1:{port}/readyz"))[0] == 503
        assert not node.worker_pids()
        sick.unlink()
        assert await exit_code(node, timeout=60) == 0
        checks = [e["ok"] for e in node.events("node_check")]
        assert checks[0] is False and checks[-1] is True


@pytest.mark.etcd
async def test_a_check_failing_while_running_quarantines_and_the_spare_takes_over(
    tmp_path: Path, server: EtcdMember
) -> None:
    flags = ["--node-check", check_flag("--sick-dir", str(tmp_path)),
             "--node-check-interval", "0.3"]
    async with healing_job(tmp_path, server.endpoint, flags=flags) as job:
        nodes = [await job.start(f"n{i}") for i in range(3)]
        for node in nodes:
            await node.sup.out.expect(r"^ready \d n\d world 3 ", timeout=30)
        spare = await job.start("n3")
        await spare.sup.err.expect("waiting as a spare", timeout=30)
        (tmp_path / "sick-n1").touch()
        assert await exit_code(nodes[1], timeout=60) == EXIT_QUARANTINED
        assert "quarantining node n1: node check exited with code 1" in nodes[1].sup.err.text()
        await group_without(nodes[1], [nodes[0], nodes[2], spare])
        job.done.touch()
        for node in (nodes[0], nodes[2], spare):
            assert await exit_code(node, timeout=60) == 0
        assert await job.key("ctl/restarts") is None  # a quarantine uses no budget
        assert spare.events("spare_admitted")
