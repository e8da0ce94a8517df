"""The real daemon as a service: HTTP probes and sd_notify seen from outside."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import aiohttp
import anyio
from prometheus_client.parser import text_string_to_metric_families

from tests.support import deps
from tests.support.daemon import Supervised, supervisor
from tests.support.notify import notify_socket, receive_notification
from tests.support.paths import FAKE_WORKER, REPO
from tests.support.processes import wait_dead
from tests.support.users import unreachable


async def health_url(sup: Supervised) -> str:
    return f"http://127.0.0.1:{await sup.health_port()}"


async def get(url: str) -> tuple[int, dict[str, object]]:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return resp.status, await resp.json()


async def test_readyz_follows_the_run_through_a_restart(tmp_path: Path) -> None:
    # rank 1 ignores SIGTERM, so the failure stop lasts the whole 1 s grace: a window
    # in which /readyz must say 503 while /healthz stays 200
    args = ["--health-port", "0", "--nproc-per-node", "2", "--max-restarts", "1",
            "--shutdown-timeout", "1", "--log-dir", str(tmp_path), FAKE_WORKER,
            "--usr1-exit", "3", "--fail-rank", "0", "--fail-attempts", "1", "--ignore-term",
            "--trap", "1"]
    async with supervisor(args) as sup:
        url = await health_url(sup)
        for _ in range(2):
            await sup.out.expect(r"^ready \d \d+ 0$")
        status, body = await get(url + "/readyz")
        assert status == 200, body
        sup.signal(signal.SIGUSR1)  # forwarded: rank 0 exits 3
        await sup.err.expect(r"running -> stopping")
        assert (await get(url + "/readyz"))[0] == 503
        assert (await get(url + "/healthz"))[0] == 200
        await sup.err.expect(r"starting -> running", timeout=20)
        status, body = await get(url + "/readyz")
        assert status == 200, body
        status, doc = await get(url + "/status")
        assert doc["restarts"] == {"used": 1, "max": 1, "left": 0}
        assert doc["state"] == "running" and doc["attempt"] == 1  # attempt_1: the second
        failure = doc["last_failure"]
        assert isinstance(failure, dict) and failure["exit_code"] == 3
        async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
            text = await resp.text()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert any("restart" in n for n in families)
        # the daemon froze its start-up heap (tens of thousands of objects) before serving
        frozen = families["elastic_supervisor_gc_frozen_objects"].samples[0].value
        assert frozen > 10_000, frozen
        sup.signal(signal.SIGTERM)
        assert await sup.wait() == 128 + signal.SIGTERM






async def test_sd_notify_ready_status_watchdog_stopping(tmp_path: Path) -> None:
    env_dir = tmp_path / "env"
    env_dir.mkdir()
    sock = notify_socket(tmp_path / "notify")
    args = ["--health-port", "0", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
            FAKE_WORKER, "--dump-env", str(env_dir), "--hang"]
    env = {"NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "400000"}
    with sock:
        async with supervisor(args, env=env) as sup:
            seen: list[str] = []
            with anyio.fail_after(15):
                while not any("READY=1" in m for m in seen):
                    pid, message = await receive_notification(sock)
                    assert pid == sup.pid  # only the supervisor itself talks to systemd
                    seen.append(message)
            assert "running attempt 0" in "".join(seen)  # attempt_0, the first
            assert any(m.startswith("WATCHDOG=1") for m in seen)
            # pings keep coming at about WATCHDOG_USEC/2
            pings = 0
            with anyio.fail_after(5):
                while pings < 3:
                    pid, message = await receive_notification(sock)
                    assert pid == sup.pid
                    pings += "WATCHDOG=1" in message
            for _ in range(2):
                await sup.out.expect(r"^ready")
            sup.signal(signal.SIGTERM)
            with anyio.fail_after(10):
                while True:
                    pid, message = await receive_notification(sock)
                    if "STOPPING=1" in message:
                        break
            assert await sup.wait() == 128 + signal.SIGTERM
    for rank in range(2):
        worker_env = json.loads((env_dir / f"{rank}.json").read_text())
        assert not {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"} & worker_env.keys()


async def test_no_ready_on_bad_config(tmp_path: Path) -> None:
    sock = notify_socket(tmp_path / "notify")
    with sock:
        async with supervisor(["--health-port", "0", "--nnodes", "x", FAKE_WORKER],
                              env={"NOTIFY_SOCKET": str(tmp_path / "notify")}) as sup:
            assert await sup.wait() == 2
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            data = b""
        assert b"READY=1" not in data


async def test_status_command_reads_a_live_supervisor(tmp_path: Path) -> None:
    args = ["--health-port", "0", "--nproc-per-node", "2", "--log-dir", str(tmp_path),
            FAKE_WORKER, "--hang"]
    async with supervisor(args) as sup:
        url = await health_url(sup)
        for _ in range(2):
            await sup.out.expect(r"^ready")
        proc = await anyio.run_process(
            [sys.executable, "-m", "supervisor", "status", "--url", url, "--json"], check=False
        )
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["state"] == "running" and len(doc["workers"]) == 2
        table = await anyio.run_process(
            [sys.executable, "-m", "supervisor", "status", "--url", url], check=False
        )
        assert table.returncode == 0 and b"running" in table.stdout
        sup.signal(signal.SIGTERM)
        assert await sup.wait() == 143


NOBODY = 65534


def _uid(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Uid:"))


def _as_nobody(setpriv: str, python: str, env: dict[str, str]) -> bool:
    """Whether ``python``, run as nobody, is a Python of this minor version with our
    dependencies importable (an interpreter installed under a 0700 home, like pyenv's
    under ``/root``, is not usable by another user)."""
    probe = ("import subprocess, sys, anyio, msgspec, psutil, aiohttp\n"
             "subprocess.run([sys.executable, '-c', 'pass'], check=True)  # it spawns workers\n"
             "print(sys.version_info[:2])")
    try:
        out = subprocess.run(
            [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--",
             python, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    except OSError:
        return False
    return out.returncode == 0 and out.stdout.strip() == str(sys.version_info[:2])


def _runtime_distributions() -> list[importlib.metadata.Distribution]:
    """The installed distributions of pyproject.toml's dependencies, recursively."""
    with open(REPO / "pyproject.toml", "rb") as f:
        todo = list(tomllib.load(f)["project"]["dependencies"])
    seen: set[str] = set()
    found = []
    while todo:
        name = re.match(r"[A-Za-z0-9_.-]+", todo.pop()).group(0)  # type: ignore[union-attr]
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # a requirement for another Python version (its marker is false)
        found.append(dist)
        for req in dist.requires or []:
            if "extra ==" not in req.partition(";")[2]:
                todo.append(req)
    return found


def _copy_for_nobody(base: Path) -> tuple[list[str], str]:
    """This checkout's package and fake worker plus the installed run-time dependencies,
    copied below ``base`` (which nobody can read): for a clone that sits below a 0700
    directory. Returns the PYTHONPATH entries and the fake worker's path."""
    site_dir, src = base / "site", base / "src"
    for dist in _runtime_distributions():
        tops = {Path(str(f)).parts[0] for f in dist.files or []}
        for top in tops - {"..", "__pycache__"}:
            origin = Path(str(dist.locate_file(top)))
            if top.endswith((".dist-info", ".pth")) or not origin.exists():
                continue
            if origin.is_dir():
                shutil.copytree(origin, site_dir / top, dirs_exist_ok=True)
            else:
                site_dir.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, site_dir / top)
    shutil.copytree(REPO / "supervisor", src / "supervisor")
    worker = src / "workers" / Path(FAKE_WORKER).name
    worker.parent.mkdir(parents=True)
    shutil.copy2(FAKE_WORKER, worker)
    subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(base)], check=True)
    return [str(site_dir), str(src)], str(worker)


async def test_unprivileged_service_user_restarts_and_stops_cleanly() -> None:
    """docs/deploy.md runs the unit as an unprivileged user. As ``nobody``: the supervisor,
    its workers and standbys run as that user, a failure restarts the group (warm), the
    health endpoint answers, SIGTERM stops it all and leaves no process behind."""
    if os.geteuid() != 0:
        deps.missing("root, to drop to user nobody (run the tests as root, as .ci/run does)")
    setpriv = deps.need_binary("setpriv", "apt-get install util-linux")
    with tempfile.TemporaryDirectory(prefix="unprivileged-", dir="/tmp") as base:
        os.chown(base, NOBODY, NOBODY)  # pytest's tmp_path is in root's private directory
        await _run_as_nobody(setpriv, Path(base))


async def _run_as_nobody(setpriv: str, base: Path) -> None:
    paths, worker = [*site.getsitepackages(), str(REPO)], FAKE_WORKER
    if unreachable(NOBODY, [p for p in paths if os.path.isdir(p)]) is not None:
        # a clone below a 0700 home: nobody cannot enter it, so it gets copies of what runs
        paths, worker = _copy_for_nobody(base / "code")
    # our dependencies and this checkout, for an interpreter nobody can run
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    minor = ".".join(map(str, sys.version_info[:2]))
    candidates = [sys.executable, os.path.realpath(sys.executable), f"/usr/bin/python{minor}"]
    python = next((p for p in candidates if _as_nobody(setpriv, p, env)), None)
    if python is None:
        deps.missing(f"a Python {minor} that user nobody can run (tried {candidates}); "
                     f"apt-get install python{minor}")
    launcher = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--",
                python, "-m", "supervisor", "run"]
    logs = base / "logs"
    args = ["--health-port", "0", "--nproc-per-node", "2", "--max-restarts", "2",
            "--loop-nice", "-15", "--log-dir", str(logs), "--log-level", "debug", worker,
            "--usr1-exit", "3",
            "--fail-rank", "0", "--fail-attempts", "1", "--trap", "1"]
    async with supervisor(args, env={"PYTHONPATH": env["PYTHONPATH"]}, cwd=base,
                          launcher=launcher) as sup:
        url = await health_url(sup)
        first = [int((await sup.out.expect(r"^ready \d (\d+) 0$")).group(1))
                 for _ in range(2)]
        standbys = [int((await sup.err.expect(STANDBY)).group(1)) for _ in range(2)]
        assert {_uid(p) for p in [sup.pid, *first, *standbys]} == {NOBODY}
        # not root: the event loop stays at nice 0, and the log says why
        assert os.getpriority(os.PRIO_PROCESS, sup.pid) == 0
        assert re.search(r"event loop at nice 0: cannot raise it .*CAP_SYS_NICE", sup.err.text())
        assert (await get(url + "/readyz"))[0] == 200
        sup.signal(signal.SIGUSR1)  # forwarded: rank 0 exits 3, the group restarts
        second = [int((await sup.out.expect(r"^ready \d (\d+) 1$")).group(1))
                  for _ in range(2)]
        assert sorted(second) == sorted(standbys)  # the restart ran in the standbys
        assert (await get(url + "/readyz"))[0] == 200
        sup.signal(signal.SIGTERM)
        assert await sup.wait() == 128 + signal.SIGTERM
    every_standby = [int(pid) for pid in re.findall(STANDBY, sup.err.text())]
    # the second attempt's (started one at a time; the stop halts that) were never used
    assert every_standby[:2] == standbys and len(every_standby) <= 4
    await wait_dead([*first, *second, *every_standby], timeout=5.0)
    events = [json.loads(line)
              for line in (logs / "none" / "events.jsonl").read_text().splitlines()]
    assert [e.get("warm") for e in events if e["event"] == "group_started"] == [None, [0, 1]]


STANDBY = r"standby for local rank \d started as pid (\d+)"
