"""The fork server: one preloaded interpreter per node forks each rank's standby.

Every test runs a real fork server and real standbys under ``tests/workers/
forkserver_driver.py`` (which plays the supervisor: a child subreaper, so the standbys are
reparented to it) and compares what ``tests/workers/fork_probe.py`` records inside a
forked standby with what it records in a cold start of the same command.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from supervisor.core.envs import PER_ATTEMPT_ENV, interpreter
from supervisor.workers.spawn import DeathSignal
from supervisor.workers.warm.forkserver import (
    ForkServer,
    ForkServerConfig,
    ForkServerError,
    Wanted,
    cold_path0,
)
from tests.support import deps
from tests.support.paths import REPO, WORKERS
from tests.support.users import as_user, closed_to, python_for

DRIVER = str(WORKERS / "forkserver_driver.py")
PROBE = str(WORKERS / "fork_probe.py")
WATCH = [*PER_ATTEMPT_ENV, "LOCAL_RANK"]
RUN_TIMEOUT = 90.0


def node_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in WATCH and not k.startswith(("PYTEST", "COV_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [extra.pop("PYTHONPATH", ""),
                                                      str(REPO)]))
    env.update(extra)
    return env


def drive(config: dict[str, Any], *, user: str | None = None,
          python: str = sys.executable) -> list[dict[str, Any]]:
    """Run the driver; its JSON lines."""
    argv = [python, DRIVER, json.dumps(config)]
    if user is not None:
        argv = [*as_user(user), *argv]
    path = os.pathsep.join([str(REPO), *[p for p in sys.path if "-packages" in p]])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT,
                          env={**os.environ, "PYTHONPATH": path}, cwd=config.get("cwd"))
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return lines


def job(tmp_path: Path, script: Path | None = None, **extra: Any) -> dict[str, Any]:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    config: dict[str, Any] = {
        "argv": [str(script or PROBE), str(out)], "ranks": 2, "cwd": str(cwd),
        "env": node_env(), "watch": WATCH,
        "per_attempt": {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"},
    }
    config.update(extra)
    return config


def records(tmp_path: Path, tag: str, ranks: int = 2) -> list[dict[str, Any]]:
    return [json.loads((tmp_path / "out" / f"{tag}_{r}.json").read_text())
            for r in range(ranks)]


def run_both(tmp_path: Path, config: dict[str, Any]) -> tuple[list[dict[str, Any]],
                                                                list[dict[str, Any]], int]:
    """The records of a cold and a warm (forked) run of ``config``; the driver's pid of
    the warm run."""
    cold = {**config, "cold": True, "env": {**config["env"], "PROBE_TAG": "cold"}}
    for line in drive(cold):
        assert line.get("exit") == 0, line
    warm = {**config, "env": {**config["env"], "PROBE_TAG": "warm"}}
    lines = drive(warm)
    ready = next(line["ready"] for line in lines if "ready" in line)
    assert ready["ok"], ready
    assert [line["exit"] for line in lines if "exit" in line] == [0] * config["ranks"]
    driver = next(line["driver"] for line in lines if "driver" in line)
    return records(tmp_path, "cold", config["ranks"]), records(
        tmp_path, "warm", config["ranks"]), driver


def ready_report(config: dict[str, Any]) -> dict[str, Any]:
    lines = drive({**config, "ranks": 0})
    report: dict[str, Any] = next(line["ready"] for line in lines if "ready" in line)
    return report


# ---------------------------------------------------------------------- equivalence
def test_forked_standby_runs_the_script_as_a_cold_start_does(tmp_path: Path) -> None:
    config = job(tmp_path, preload=["xml.dom.minidom"])
    cold, warm, driver = run_both(tmp_path, config)
    for c, w in zip(cold, warm, strict=True):
        for key in ("argv", "path", "flags", "fds", "own_session", "signals", "blocked",
                    "policy", "nice", "affinity", "main_keys", "threads"):
            assert w[key] == c[key], key
        assert {k: v for k, v in w["env"].items() if k != "PROBE_TAG"} == {
            k: v for k, v in c["env"].items() if k != "PROBE_TAG"}
        assert w["ppid"] == driver  # reparented to the supervisor, not the fork server
        assert set(c["modules_at_start"]) <= set(w["modules_at_start"])
        assert "xml.dom.minidom" in w["modules_at_start"]


@pytest.mark.xdist_group("torch")
def test_forked_standbys_get_their_own_random_state(tmp_path: Path) -> None:
    deps.need_module("torch")
    deps.need_module("numpy")
    config = job(tmp_path, preload=["torch", "numpy.random"], ranks=3)
    _cold, warm, _driver = run_both(tmp_path, config)
    states = [w["random"] for w in warm]
    for key in ("random", "uuid4", "torch_seed", "torch_rand", "numpy_rand"):
        assert len({json.dumps(s[key]) for s in states}) == len(states), key
    # documented difference: the string-hash seed is the fork server's (PYTHONHASHSEED)
    assert len({s["hash"] for s in states}) == 1


def test_standby_runs_at_normal_priority_when_the_server_is_not_root() -> None:
    """The server imports and forks at the priority it was started with (a cold worker's):
    without CAP_SYS_NICE a child could never get back to SCHED_OTHER from a lower one."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the fork server as another user")
    python = python_for("65534")
    if python is None:
        pytest.skip(f"no python{sys.version_info.major}.{sys.version_info.minor} that "
                    "user nobody may run")
    packages = [p for p in sys.path if "-packages" in p and os.path.isdir(p)]
    closed = closed_to(65534, [DRIVER, PROBE, REPO / "supervisor", *packages])
    if closed is not None:
        pytest.skip(closed)
    with tempfile.TemporaryDirectory(dir="/tmp") as where:  # pytest's tmp is root's only
        base = Path(where)
        base.chmod(0o755)
        config = job(base, preload=["xml.dom.minidom"], ranks=1)
        for sub in ("out", "cwd"):
            (base / sub).chmod(0o777)
        env = {**config["env"], "PROBE_TAG": "nobody",
               "PYTHONPATH": os.pathsep.join([config["env"]["PYTHONPATH"], *packages])}
        lines = drive({**config, "env": env}, user="65534", python=python)
        assert next(line["ready"] for line in lines if "ready" in line)["ok"], lines
        (record,) = records(base, "nobody", 1)
    assert (record["policy"], record["nice"]) == (os.SCHED_OTHER, 0)


def test_standbys_outlive_a_fork_server_that_is_stopped(tmp_path: Path) -> None:
    config = job(tmp_path, preload=["xml.dom.minidom"], stop_server_first=True)
    lines = drive({**config, "env": {**config["env"], "PROBE_TAG": "after"}})
    assert [line["exit"] for line in lines if "exit" in line] == [0, 0]
    assert all(r["ppid"] == lines[0]["driver"] for r in records(tmp_path, "after"))


# ---------------------------------------------------------------------- sys.path
SHADOW = "colorsys"  # a stdlib module nobody imports at start-up


def shadow_file(where: Path) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"{SHADOW}.py"
    path.write_text("SHADOWED = True\n")
    return path


@pytest.mark.parametrize("place", ["cwd", "script_dir", "pythonpath"])
def test_preload_finds_the_module_a_cold_start_finds(tmp_path: Path, place: str) -> None:
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    script = scripts / "probe.py"
    shutil.copy(PROBE, script)
    config = job(tmp_path, script, preload=[SHADOW])
    config["env"]["SHADOW"] = SHADOW
    if place == "cwd":
        planted = shadow_file(tmp_path / "cwd")
    elif place == "script_dir":
        planted = shadow_file(scripts)
    else:
        planted = shadow_file(tmp_path / "pp")
        config["env"]["PYTHONPATH"] = f"{tmp_path / 'pp'}{os.pathsep}{config['env']['PYTHONPATH']}"
    cold, warm, _driver = run_both(tmp_path, config)
    assert [w["shadow_file"] for w in warm] == [c["shadow_file"] for c in cold]
    shadowed = cold[0]["shadow_file"] == str(planted)
    assert shadowed is (place != "cwd")  # the working directory is not on a script's path


def test_cold_path0_is_what_python_puts_first(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("import sys; print(repr(sys.path[0]))\n")
    env = {"PATH": os.environ.get("PATH", "")}
    for command in ([str(script)], ["-c", "import sys; print(repr(sys.path[0]))"],
                    ["-m", "s"]):
        seen = subprocess.run([sys.executable, *command], capture_output=True, text=True,
                              cwd=tmp_path, env=env, check=True, timeout=30).stdout.strip()
        assert seen == repr(cold_path0(command, str(tmp_path), env))
    assert cold_path0(["-m", "s"], str(tmp_path), {"PYTHONSAFEPATH": "1"}) is None


def test_auto_skips_a_module_that_would_not_come_from_a_distribution(tmp_path: Path) -> None:
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "msgspec.py").write_text("raise SystemExit('the shadow was imported')\n")
    script = scripts / "probe.py"
    shutil.copy(PROBE, script)
    report = ready_report(job(tmp_path, script, auto=["msgspec"]))
    assert report["ok"], report
    assert any(s.startswith("msgspec (would come from") for s in report["skipped"]), report


# ---------------------------------------------------------------------- taint
READERS = {
    "subscript": "import os\ntry:\n    os.environ['RANK']\nexcept KeyError:\n    pass\n",
    "get": "import os\nos.environ.get('RANK')\n",
    "getenv": "import os\nos.getenv('LOCAL_RANK', '0')\n",
    "contains": "import os\n'MASTER_PORT' in os.environ\n",
    "copy": "import os\nenv = os.environ.copy()\nenv.get('WORLD_SIZE')\n",
    "environb": "import os\nos.environb.get(b'RANK')\n",
}
HARMLESS = {
    "copy_only": "import os\nenv = os.environ.copy()\nenv2 = env.copy()\n",
    "iteration": "import os\nnames = [k for k in os.environ]\nvalues = list(os.environ.items())\n",
    "other_name": "import os\nos.environ.get('HOME')\n",
}


def preload_module(tmp_path: Path, code: str) -> dict[str, Any]:
    pp = tmp_path / "pp"
    pp.mkdir(exist_ok=True)
    (pp / "reader.py").write_text(code)
    config = job(tmp_path, preload=["reader"])
    config["env"]["PYTHONPATH"] = f"{pp}{os.pathsep}{config['env']['PYTHONPATH']}"
    return ready_report(config)


@pytest.mark.parametrize("how", sorted(READERS))
def test_a_module_that_reads_a_per_attempt_or_rank_name_taints(tmp_path: Path,
                                                               how: str) -> None:
    report = preload_module(tmp_path, READERS[how])
    assert (report["ok"], report["tainted"]) == (False, "reader"), report


@pytest.mark.parametrize("how", sorted(HARMLESS))
def test_a_copy_or_an_iteration_alone_does_not_taint(tmp_path: Path, how: str) -> None:
    report = preload_module(tmp_path, HARMLESS[how])
    assert report["ok"], report


@pytest.mark.xdist_group("torch")
def test_torch_and_dynamo_stay_preloadable(tmp_path: Path) -> None:
    deps.need_module("torch")
    report = ready_report(job(tmp_path, preload=["torch", "torch._dynamo"]))
    assert report == {
        "ok": True, "error": "", "tainted": None, "threaded": None, "skipped": []}


# ---------------------------------------------------------------------- cheap forks
def test_one_request_forks_a_standby_per_rank_and_one_that_dies_holds_up_none(
        tmp_path: Path) -> None:
    """An attempt's standbys come from one intermediate child and set themselves up one
    after another; rank 1's set-up fails (CPUs that do not exist): 0 and 2 still run."""
    config = job(tmp_path, preload=["xml.dom.minidom"], ranks=3, cpus={"1": [1 << 20]})
    lines = drive({**config, "env": {**config["env"], "PROBE_TAG": "batch"}})
    assert [line["exit"] for line in lines if "exit" in line] == [0, None, 0], lines
    driver = lines[0]["driver"]
    for rank in (0, 2):
        record = json.loads((tmp_path / "out" / f"batch_{rank}.json").read_text())
        assert record["ppid"] == driver and record["env"]["LOCAL_RANK"] == str(rank)


# ---------------------------------------------------------------------- unsafe preloads
def test_a_preload_that_leaves_a_thread_is_refused(tmp_path: Path) -> None:
    report = preload_module(
        tmp_path, "import threading\nthreading.Thread(target=threading.Event().wait,"
                  " daemon=True).start()\n")
    assert (report["ok"], report["threaded"]) == (False, "reader"), report


def test_a_preload_that_kills_the_server_is_reported(tmp_path: Path) -> None:
    report = preload_module(tmp_path, "import os\nos.kill(os.getpid(), 9)\n")
    assert not report["ok"] and "exited" in report["error"], report


def test_fork_from_a_dead_server_raises(tmp_path: Path) -> None:
    config = ForkServerConfig(python=sys.executable, env=node_env(), cwd=str(tmp_path),
                              path0=str(tmp_path), preload=("xml.dom.minidom",))
    server = ForkServer.start(config, DeathSignal(), interpreter(sys.executable))
    try:
        assert server.wait_ready(60).ok
        os.kill(server.pid, signal.SIGKILL)
        os.waitid(os.P_PIDFD, server.process.pidfd, os.WEXITED | os.WNOWAIT)
        with pytest.raises(ForkServerError):
            server.fork([Wanted(0, node_env())])
    finally:
        server.stop()
