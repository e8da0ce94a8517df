"""Standbys start in their rank's environment (issue 15 item 1, issue 18 item 4), and
``--preload`` imports modules in them before a restart (issue 15 item 2).

Interpreter start-up code (``sitecustomize``, ``.pth`` files, ``LD_PRELOAD`` constructors)
must see in a standby what it sees in a cold worker, except the per-attempt variables,
which a standby is started without; what start-up sets in ``os.environ`` must survive the
hand-off, as it does in a cold start.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import anyio
import pytest

from supervisor.core.envs import PER_ATTEMPT_ENV
from supervisor.workers.warm.standby import env_mismatch, standby_env
from tests.support import deps
from tests.support.daemon import supervisor
from tests.support.eventlog import warm_ranks
from tests.support.paths import FAKE_WORKER, TESTS, WORKERS

PROBE = str(TESTS / "workers" / "probe_main.py")
BASE = ["--health-port", "0", "--shutdown-timeout", "5", "--log-level", "debug"]
EMBEDDED_RUN = str(WORKERS / "embedded_run.py")
# the embedded API's run: standbys that import for themselves, at once after a launch
EMBEDDED = [sys.executable, "-c",
            "import runpy, sys, supervisor.workers.warm.pool as g; g.PRELOAD_AFTER = 0.0; "
            f"sys.argv[0] = {EMBEDDED_RUN!r}; runpy.run_path({EMBEDDED_RUN!r}, "
            "run_name='__main__')"]

SITECUSTOMIZE = (WORKERS / "warm_sitecustomize.py").read_text()
PTH = 'import os; os.environ.setdefault("PTH_SEEN", os.environ.get("LOCAL_RANK", "none"))\n'
PRELOAD_C = r'''
#include <stdlib.h>
__attribute__((constructor)) static void probe(void) {
    const char *lr = getenv("LOCAL_RANK");
    if (lr) setenv("PRELOAD_SEEN", lr, 0);
}
'''


def start_up_env(tmp_path: Path) -> dict[str, str]:
    """PYTHONPATH with a sitecustomize (which adds a .pth dir) and, if cc exists, an
    LD_PRELOAD library: each leaves a variable behind when it ran in a rank's env."""
    site = tmp_path / "site"
    (site / "pthdir").mkdir(parents=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (site / "pthdir" / "probe.pth").write_text(PTH)
    env = {"PYTHONPATH": f"{site}:{TESTS.parent}"}
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is not None:
        src = tmp_path / "preload.c"
        src.write_text(PRELOAD_C)
        lib = tmp_path / "libprobe.so"
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
        env["LD_PRELOAD"] = str(lib)
    return env


def record(out: Path, restart: int, rank: int) -> dict[str, object]:
    data: dict[str, object] = json.loads((out / f"{restart}_{rank}.json").read_text())
    return data


async def test_start_up_code_sees_the_rank_environment_warm_as_cold(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    logs = tmp_path / "logs"
    gate = tmp_path / "gate"
    env = {**start_up_env(tmp_path), "PROBE_GATE": str(gate)}
    args = [*BASE, "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", str(logs),
            PROBE, str(out)]
    async with supervisor(args, env=env, cwd=tmp_path) as sup:
        for _ in range(2):
            await sup.err.expect(r"standby for local rank \d started as pid")
        gate.touch()  # both standbys started (one at a time): now restart 0 may fail
        assert await sup.wait() == 0
    assert warm_ranks(logs) == [None, [0, 1]]
    for rank in range(2):
        cold_env = record(out, 0, rank)["env"]
        warm_env = record(out, 1, rank)["env"]
        assert isinstance(cold_env, dict) and isinstance(warm_env, dict)
        # set during start-up with setdefault, by sitecustomize and by a .pth file: the
        # same cold and warm (the hand-off applies its variables on top, it wipes nothing)
        assert cold_env["SITE_SETDEFAULT"] == warm_env["SITE_SETDEFAULT"] == f"lr{rank}"
        assert cold_env["PTH_SEEN"] == warm_env["PTH_SEEN"] == str(rank)
        if "LD_PRELOAD" in env:
            assert cold_env["PRELOAD_SEEN"] == warm_env["PRELOAD_SEEN"] == str(rank)
        # the documented difference: per-attempt variables are unset during a standby's
        # start-up (RANK is one), so start-up code that reads one sees it unset
        assert cold_env["SITE_SAW_RANK"] == str(rank)
        assert warm_env["SITE_SAW_RANK"] == "unset"
        same = {k for k in cold_env if k not in PER_ATTEMPT_ENV and k != "SITE_SAW_RANK"}
        assert {k: warm_env.get(k) for k in same} == {k: cold_env[k] for k in same}
        assert set(warm_env) == set(cold_env)
        # and the per-attempt variables themselves are the attempt's own
        assert warm_env["RANK"] == str(rank)
        assert warm_env["TORCHELASTIC_RESTART_COUNT"] == "1"


async def test_uncaught_exception_sets_sys_last_value_warm_as_cold(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    logs = tmp_path / "logs"
    args = [*BASE, "--max-restarts", "1", "--log-dir", str(logs), PROBE, str(out), "raise"]
    async with supervisor(args) as sup:
        assert await sup.wait() == 1
    assert warm_ranks(logs) == [None, [0]]
    cold, warm = ((out / f"{i}_0.last").read_text() for i in range(2))
    assert cold == warm == "ValueError('probe failure on rank 0')"
    # stdin is /dev/null opened read-write, as subprocess.DEVNULL gives a cold worker
    assert record(out, 0, 0)["stdin_access"] == record(out, 1, 0)["stdin_access"] == os.O_RDWR


async def test_preloaded_modules_are_imported_before_every_attempt(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    logs = tmp_path / "logs"
    gate = tmp_path / "gate"
    args = [*BASE, "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", str(logs),
            "--preload", "colorsys,xml.dom.minidom", PROBE, str(out)]
    async with supervisor(args, env={"PROBE_GATE": str(gate)}) as sup:
        for _ in range(4):  # the first attempt's standbys, then the restart's
            await sup.err.expect(r"standby for local rank \d preloaded colorsys,xml.dom.minidom")
        gate.touch()  # now restart 0 may fail
        assert await sup.wait() == 0
    assert warm_ranks(logs) == [[0, 1], [0, 1]]
    for restart in range(2):
        for rank in range(2):
            modules = record(out, restart, rank)["modules"]
            assert isinstance(modules, list)
            assert {"colorsys", "xml.dom.minidom"} <= set(modules)


async def test_failed_preload_means_a_cold_start_and_one_warning(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    args = [*BASE, "--max-restarts", "1", "--log-dir", str(logs),
            "--preload", "no_such_module_for_the_test",
            FAKE_WORKER, "--hang", "--usr1-exit", "1", "--fail-attempts", "1"]
    async with supervisor(args) as sup:
        pid = int((await sup.out.expect(r"^ready 0 (\d+) 0$")).group(1))
        await sup.err.expect(  # the node's fork server failed (not a standby of its own)
            r"fork server: preloading "
            r"'no_such_module_for_the_test' failed: ModuleNotFoundError")
        os.kill(pid, signal.SIGUSR1)  # the job goes on: the restart is cold too
        await sup.out.expect(r"^ready 0 \d+ 1$")
        found = re.search(r"health endpoint on http://[^:]+:(\d+)", sup.err.text())
        assert found is not None
        port = int(found.group(1))
        metrics = await anyio.to_thread.run_sync(_get, f"http://127.0.0.1:{port}/metrics")
        # both attempts' rank: the first attempt waited for the failed import, then cold
        assert re.search(r'standby_cold_fallbacks_total\{reason="preload_failed"\} 2\.0',
                         metrics), metrics
        sup.signal(signal.SIGTERM)
        assert await sup.wait() == 128 + signal.SIGTERM
    assert warm_ranks(logs) == [None, None]
    assert sup.err.text().count("no_such_module_for_the_test' failed") == 1


async def test_preload_is_refused_for_a_bad_module_name(tmp_path: Path) -> None:
    args = [*BASE, "--preload", "torch,not a module", FAKE_WORKER]
    async with supervisor(args) as sup:
        assert await sup.wait() == 2
        await sup.err.expect(r"preload: 'not a module' is not a module name")


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


# ---------------------------------------------------------------------- pure checks
def test_standby_env_leaves_out_exactly_the_per_attempt_variables() -> None:
    env = {name: "x" for name in PER_ATTEMPT_ENV} | {"LOCAL_RANK": "0", "PATH": "/bin"}
    assert standby_env(env) == {"LOCAL_RANK": "0", "PATH": "/bin"}


@pytest.mark.parametrize(
    ("started", "worker", "changed"),
    [
        ({"A": "1"}, {"A": "1", "RANK": "3", "MASTER_PORT": "9"}, None),
        ({"A": "1"}, {"A": "2", "RANK": "3"}, "A"),
        ({"A": "1"}, {"A": "1", "B": "new"}, "B"),
        ({"A": "1", "GONE": "x"}, {"A": "1"}, "GONE"),
    ],
)
def test_env_mismatch_names_the_variable_that_differs(
    started: dict[str, str], worker: dict[str, str], changed: str | None
) -> None:
    assert env_mismatch(started, worker) == changed


# ---------------------------------------------------------------------- --preload auto
AUTO_JOB = (WORKERS / "auto_preload_job.py").read_text()
RANKREADER_LOCAL = 'import os\nRANK_AT_IMPORT = os.environ.get("RANK", "unset")\n'


def install_rankreader(target: Path) -> None:
    """Install the test distribution (it reads RANK at import) into ``target``."""
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
         "--no-build-isolation", "--target", str(target),
         str(TESTS / "data" / "rankreader_pkg")],
        capture_output=True, text=True, check=False)
    if done.returncode != 0:  # setuptools < 70 without `wheel`: invalid command 'bdist_wheel'
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        # the build's own error, not pip's summary of it (which says "see above")
        cause = next((line for line in lines if line.startswith("error: ")
                      and "subprocess-exited-with-error" not in line),
                     lines[-1] if lines else f"exit {done.returncode}")
        deps.missing(f"pip cannot build the test distribution ({cause}); "
                     "pip install wheel 'setuptools>=70'")


async def test_preload_auto_learns_imports_and_never_preloads_a_rank_reader(
    tmp_path: Path,
) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "job.py").write_text(AUTO_JOB)
    (job_dir / "rankreader_local.py").write_text(RANKREADER_LOCAL)  # next to the script
    site = tmp_path / "site"
    install_rankreader(site)
    out = tmp_path / "out"
    out.mkdir()
    import psutil

    installed = Path(psutil.__file__).read_bytes()
    args = [*BASE, "--max-restarts", "2", "--log-dir", str(tmp_path / "logs"),
            "--preload", "auto", str(job_dir / "job.py"), str(out)]
    # the embedded API's standbys (each learns from its rank's last worker)
    async with supervisor(args, env={"PYTHONPATH": str(site)}, launcher=EMBEDDED) as sup:
        # attempt 0 ran cold: its mapped extension modules (psutil) are preloaded
        await sup.err.expect(r"standby for local rank 0 preloaded auto in", timeout=60)
        (out / "go0").touch()
        # attempt 1 ran warm and recorded its imports; the installed package that reads
        # RANK taints the next standby, which is replaced by one without it
        await sup.err.expect(r"--preload auto: 'rankreader_pkg' reads RANK while it imports; "
                             r"package 'rankreader_pkg' is never preloaded", timeout=60)
        await sup.err.expect(r"standby for local rank 0 preloaded auto in", timeout=60)
        (out / "go1").touch()
        await sup.out.expect(r"^recorded 2$", timeout=60)
        (out / "go2").touch()
        assert await sup.wait() == 0
    records = [json.loads((out / f"{i}.json").read_text()) for i in range(3)]
    assert "psutil" not in records[0]["modules"]
    assert "psutil" in records[1]["modules"] and "psutil" in records[2]["modules"]
    for record in records:  # never preloaded, from the script's dir or installed
        assert "rankreader_pkg" not in record["modules"]
        assert "rankreader_local" not in record["modules"]
        assert record["pkg"] == record["local"] == record["rank"] == "0"
    # regression: the import recorder once wrote its list over the last module's file
    assert Path(psutil.__file__).read_bytes() == installed
