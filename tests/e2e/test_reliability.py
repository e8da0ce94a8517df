"""Reliability evidence: supervisor death under load, a clean restart after it, resource
leaks across many restarts, and the security claims of docs/security.md that need a real
daemon (what the health endpoint and the logs never show)."""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import aiohttp
import anyio
import psutil
import pytest

from tests.support.daemon import Supervised, supervisor
from tests.support.etcd import etcd_factory
from tests.support.paths import FAKE_WORKER, REPO, WORKERS
from tests.support.processes import pid_alive, wait_dead

# timing bounds against the workers' clocks: run one at a time on one xdist worker
pytestmark = pytest.mark.xdist_group("load")

LOAD = ["--health-port", "0", "--health-host", "127.0.0.1", "--nproc-per-node", "4",
        "--tee", "3", "--shutdown-timeout", "5"]


def read_events(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def health_url(sup: Supervised) -> str:
    return f"http://127.0.0.1:{await sup.health_port()}"


async def get_json(url: str) -> dict[str, object]:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        body: dict[str, object] = await resp.json()
        return body


async def workers_up(sup: Supervised, count: int, restart: int = 0) -> list[int]:
    """Pids of ``count`` workers that printed ``ready RANK PID RESTART`` (tee prefix ok)."""
    return [int((await sup.out.expect(rf"ready \d (\d+) {restart}$")).group(1))
            for _ in range(count)]


def guardian_of(sup: Supervised, workers: list[int]) -> int:
    """The supervisor's one child that is not a worker."""
    others = [c.pid for c in psutil.Process(sup.pid).children() if c.pid not in workers]
    assert len(others) == 1, others
    return others[0]


async def post_heartbeat_and_see_it_accepted(fifo: Path, pid: int, url: str) -> None:
    line = {"version": 1, "pid": pid, "scope_id": "hb", "expiration_time": -1, "signal": 0}
    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fd, json.dumps(line).encode() + b"\n")
    finally:
        os.close(fd)
    with anyio.fail_after(10):
        while "elastic_supervisor_watchdog_accepted_requests_total 1.0" not in await _text(
            url + "/metrics"
        ):
            await anyio.sleep(0.02)  # polling a counter: there is no event to wait on


# ------------------------------------------------------------------ supervisor death


async def test_sigkilled_supervisor_under_load_leaves_nothing_and_restarts_clean(
    tmp_path: Path,
) -> None:
    """SIGKILL mid-run (4 workers with grandchildren, output flowing through the pipes):
    every worker, grandchild and the guardian are gone within 1 s; a supervisor started
    again with the same log dir and run id begins a new attempt directory, adopts nothing
    and opens a fresh FIFO in place of the stale one."""
    logs, gc_file = tmp_path / "logs", tmp_path / "gc"
    fifo = tmp_path / "run" / "timer.fifo"
    common = [*LOAD, "--log-dir", str(logs), "--rdzv-id", "job7", "--timer-file", str(fifo)]
    async with supervisor([*common, FAKE_WORKER, "--grandchild", str(gc_file),
                           "--chatter", "0.002"]) as sup:
        first = await workers_up(sup, 4)
        await sup.out.expect(r"chatter 3 \d{2,}$")  # output is flowing from every rank
        grandchildren = [int(Path(f"{gc_file}.{rank}").read_text()) for rank in range(4)]
        guardian = guardian_of(sup, first)
        everything = [*first, *grandchildren, guardian]
        assert all(pid_alive(p) for p in everything)
        sup.signal(signal.SIGKILL)
        await wait_dead(everything, timeout=1.0)
        await sup.wait()
    stale = tmp_path / "stale.fifo"
    os.link(fifo, stale)  # holds the stale inode, so a new FIFO cannot get its number
    old_attempt = logs / "job7" / "attempt_0"
    old_output = (old_attempt / "3" / "stdout.log").read_bytes()
    assert b"chatter 3 10\n" in old_output

    env_dir = tmp_path / "env"
    env_dir.mkdir()
    async with supervisor([*common, FAKE_WORKER, "--dump-env", str(env_dir), "--hang"]) as again:
        url = await health_url(again)
        second = await workers_up(again, 4)
        assert not set(second) & set(first)
        status = await get_json(url + "/status")
        assert status["restarts"] == {"used": 0, "max": 0, "left": 0}
        listed = status["workers"]
        assert isinstance(listed, list) and sorted(w["pid"] for w in listed) == sorted(second)
        assert {c.pid for c in psutil.Process(again.pid).children()} - set(second) == {
            guardian_of(again, second)
        }  # nothing of the first run was adopted
        mode = os.stat(fifo)
        assert stat.S_ISFIFO(mode.st_mode) and stat.S_IMODE(mode.st_mode) == 0o600
        assert mode.st_ino != os.stat(stale).st_ino  # replaced, not reused
        await post_heartbeat_and_see_it_accepted(fifo, second[0], url)
        envs = [json.loads((env_dir / f"{r}.json").read_text()) for r in range(4)]
        assert {e["TORCHELASTIC_TIMER_FILE"] for e in envs} == {str(fifo)}
        assert {Path(e["TORCHELASTIC_ERROR_FILE"]).parent.parent.name for e in envs} == {
            "attempt_1"
        }
        again.signal(signal.SIGTERM)
        assert await again.wait() == 128 + signal.SIGTERM
    assert (old_attempt / "3" / "stdout.log").read_bytes() == old_output  # left alone
    events = read_events(logs / "job7" / "events.jsonl")
    starts = [e for e in events if e["event"] == "supervisor_started"]
    assert [e["pid"] for e in starts] == [sup.pid, again.pid]  # appended, not truncated
    assert [e["dir"] for e in events if e["event"] == "group_started"] == [
        str(old_attempt), str(logs / "job7" / "attempt_1")
    ]


async def test_sigkilled_supervisor_leaves_no_grandchild_in_its_own_session(
    tmp_path: Path,
) -> None:
    gc_file = tmp_path / "gc"
    args = [*LOAD, "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), FAKE_WORKER,
            "--grandchild", str(gc_file), "--grandchild-session"]
    grandchildren: list[int] = []
    try:
        async with supervisor(args) as sup:
            workers = await workers_up(sup, 2)
            grandchildren = [int(Path(f"{gc_file}.{rank}").read_text()) for rank in range(2)]
            sup.signal(signal.SIGKILL)
            await wait_dead(workers, timeout=1.0)
        await wait_dead(grandchildren, timeout=1.0)
    finally:
        for pid in grandchildren:  # never leave the orphans behind, whatever happened
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


async def test_graceful_stop_sweeps_a_grandchild_in_its_own_session(tmp_path: Path) -> None:
    """The normal stop path does catch session leavers: the descendants sweep and the
    child-subreaper sweep (after the worker itself died first)."""
    gc_file = tmp_path / "gc"
    args = [*LOAD, "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir",
            str(tmp_path / "logs"), FAKE_WORKER, "--grandchild", str(gc_file),
            "--grandchild-session", "--trap", "1", "--usr1-exit", "3", "--fail-rank", "1"]
    async with supervisor(args) as sup:
        await workers_up(sup, 2)
        first = [int(Path(f"{gc_file}.{rank}").read_text()) for rank in range(2)]
        sup.signal(signal.SIGUSR1)  # rank 1 exits 3 at once: its grandchild is adopted by us
        await workers_up(sup, 2, restart=1)
        await wait_dead(first, timeout=5.0)
        second = [int(Path(f"{gc_file}.{rank}").read_text()) for rank in range(2)]
        sup.signal(signal.SIGTERM)
        assert await sup.wait() == 128 + signal.SIGTERM
        await wait_dead(second, timeout=1.0)


# ------------------------------------------------------------------ leaks


async def test_hundred_failure_restarts_leak_no_fd_thread_memory_or_child(
    tmp_path: Path,
) -> None:
    """benchmarks/leak_check.py with 100 restarts: fds unchanged, no more threads (anyio's
    idle worker threads given the 10 s they live), RSS within
    5 MB, the same children, nothing left after SIGTERM."""
    out = tmp_path / "leak.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "leak_check.py"), "--restarts", "100",
           "--warmup", "10", "--timeout", "90", "--json", str(out)]
    with anyio.fail_after(110):
        result = await anyio.run_process(cmd, check=False, cwd=REPO)
    report = result.stdout.decode()
    assert result.returncode == 0, report + result.stderr.decode()[-3000:]
    data = json.loads(out.read_text())
    assert data["misses"] == [] and data["orphans"] == 0, report
    before, after = data["before"], data["after"]
    assert after["fds"] == before["fds"] and after["threads"] <= before["threads"], report
    assert after["rss_mb"] - before["rss_mb"] <= 5.0, report


# ------------------------------------------------------------------ bad inputs


@pytest.mark.parametrize("where", ["shared", "missing"])
async def test_unusable_timer_file_is_one_line_usage_error(tmp_path: Path, where: str) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o1777)
    path = shared / "timer.fifo" if where == "shared" else tmp_path / "no" / "such" / "t.fifo"
    args = ["--health-port", "0", "--log-dir", str(tmp_path / "logs"), "--timer-file",
            str(path), FAKE_WORKER]
    async with supervisor(args) as sup:
        code = await sup.wait()
    assert (code, len(sup.err.lines)) == (2, 1), sup.err.text()


BAD_ERROR_FILE = (WORKERS / "bad_error_file.py").read_text()


@pytest.mark.parametrize("kind", ["nested", "fifo"])
async def test_hostile_error_file_is_a_plain_failure(tmp_path: Path, kind: str) -> None:
    script = tmp_path / "bad_error_file.py"
    script.write_text(BAD_ERROR_FILE)
    args = ["--health-port", "0", "--max-restarts", "1", "--log-dir", str(tmp_path / "logs"),
            str(script), kind]
    restarted = False
    async with supervisor(args) as sup:
        try:
            await sup.out.expect(r"^second attempt$", timeout=5)
            restarted = True
        except (TimeoutError, AssertionError):
            pass
        code = await sup.wait() if restarted else None
    assert restarted and code == 0, sup.err.text()[-2000:]


async def test_idle_health_connections_cannot_starve_a_restart(tmp_path: Path) -> None:
    args = [*LOAD, "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir",
            str(tmp_path), FAKE_WORKER, "--trap", "1", "--usr1-exit", "3", "--fail-rank", "1"]
    restarted = False
    async with supervisor(args) as sup:
        port = int((await health_url(sup)).rsplit(":", 1)[1])
        await workers_up(sup, 2)
        resource.prlimit(sup.pid, resource.RLIMIT_NOFILE, (128, 128))  # cheap to reach
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(160)]
        try:
            for conn in held:  # a request line and one header, never finished
                conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            with anyio.move_on_after(3):  # until the server accepted what it will accept
                while len(os.listdir(f"/proc/{sup.pid}/fd")) < 127:
                    await anyio.sleep(0.02)  # the kernel has no event for this
            sup.signal(signal.SIGUSR1)  # rank 1 exits 3: the group must restart
            try:
                await sup.out.expect(r"ready \d \d+ 1$", timeout=10)
                restarted = True
            except (TimeoutError, AssertionError):
                pass
        finally:
            for conn in held:
                conn.close()
    assert restarted, sup.err.text()[-1500:]


# ------------------------------------------------------------------ what is never shown


SECRET = "hunter2-do-not-show"


async def test_health_endpoints_show_no_environment_or_command_line(tmp_path: Path) -> None:
    """docs/security.md: the health port exposes no environment variables and no command
    lines, even when both hold a secret."""
    args = [*LOAD, "--nproc-per-node", "2", "--log-dir", str(tmp_path), FAKE_WORKER, "--hang",
            "--say", SECRET]
    async with supervisor(args, env={"API_TOKEN": SECRET}) as sup:
        url = await health_url(sup)
        await workers_up(sup, 2)
        async with aiohttp.ClientSession() as session:
            for path in ("/healthz", "/readyz", "/status", "/metrics", "/openapi.json"):
                async with session.get(url + path) as resp:
                    body = await resp.text()
                    assert SECRET not in body and SECRET not in str(resp.headers), path
        sup.signal(signal.SIGTERM)
        assert await sup.wait() == 128 + signal.SIGTERM


@pytest.mark.etcd
async def test_etcd_password_never_reaches_logs_events_status_or_workers(
    tmp_path: Path,
) -> None:
    """docs/security.md: the etcd password is read from password_file, used to get a
    token, and appears nowhere: debug log, event log, /status, /metrics, worker env."""
    with etcd_factory(tmp_path) as etcd:
        server = etcd.single()
        ctl = ["etcdctl", "--endpoints", server.endpoint]
        subprocess.run([*ctl, "user", "add", f"root:{SECRET}"], check=True, capture_output=True)
        subprocess.run([*ctl, "auth", "enable"], check=True, capture_output=True)
        password_file = tmp_path / "etcd-password"
        password_file.write_text(SECRET + "\n")
        password_file.chmod(0o600)
        env_dir = tmp_path / "env"
        env_dir.mkdir()
        args = [*LOAD, "--nproc-per-node", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint",
                server.endpoint, "--rdzv-id", "secretjob", "--rdzv-conf",
                f"user=root,password_file={password_file}", "--log-level", "debug",
                "--log-dir", str(tmp_path / "logs"), FAKE_WORKER, "--hang",
                "--dump-env", str(env_dir)]
        async with supervisor(args) as sup:
            url = await health_url(sup)
            await workers_up(sup, 2)
            bodies = [await _text(url + p) for p in ("/status", "/metrics")]
            sup.signal(signal.SIGTERM)
            assert await sup.wait() == 128 + signal.SIGTERM
        seen = "\n".join([sup.err.text(), sup.out.text(), *bodies,
                          (tmp_path / "logs" / "secretjob" / "events.jsonl").read_text(),
                          *(p.read_text() for p in env_dir.iterdir())])
        assert "etcd" in sup.err.text()  # the debug log did talk about etcd
        assert SECRET not in seen


async def _text(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return await resp.text()
