"""``--preload`` imports what the cold command would import (a module that shadows the
preloaded one in the working directory, the script's directory or a PYTHONPATH entry is
found, or not, as by a cold start), for forked standbys and for the started ones of the
embedded API alike."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.support.daemon import supervisor
from tests.support.paths import REPO, WORKERS

PROBE = WORKERS / "fork_probe.py"
BASE = ["--health-port", "0", "--shutdown-timeout", "5", "--log-level", "debug"]
SHADOW = "colorsys"  # a stdlib module nobody imports at start-up
EMBEDDED_RUN = str(WORKERS / "embedded_run.py")
# the embedded API's run: standbys that import for themselves, at once after a launch
EMBEDDED = [sys.executable, "-c",
            "import runpy, sys, supervisor.workers.warm.pool as g; g.PRELOAD_AFTER = 0.0; "
            f"sys.argv[0] = {EMBEDDED_RUN!r}; runpy.run_path({EMBEDDED_RUN!r}, "
            "run_name='__main__')"]


def events(log_dir: Path) -> list[dict[str, object]]:
    path = log_dir / "none" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


async def run(args: list[str], env: dict[str, str], cwd: Path, expect: str | None,
              gate: Path, launcher: list[str] | None = None) -> None:
    """Run the job to its end; ``gate`` lets restart 0 exit once ``expect`` was logged."""
    async with supervisor(args, env=env, cwd=cwd, launcher=launcher) as sup:
        if expect is not None:
            await sup.err.expect(expect, timeout=60)
        gate.touch()
        assert await sup.wait() == 0


@pytest.mark.parametrize("standbys", ["forked", "started"])
@pytest.mark.parametrize("place", ["cwd", "script_dir", "pythonpath"])
async def test_the_preload_finds_the_module_the_cold_start_finds(
        tmp_path: Path, place: str, standbys: str) -> None:
    """Forked: every attempt runs in a forked standby, compared with a cold run of the same
    job without ``--preload``; started (the embedded API's standbys): attempt 0 is cold."""
    scripts, cwd, pp, out = (tmp_path / n for n in ("scripts", "cwd", "pp", "out"))
    for d in (scripts, cwd, pp, out):
        d.mkdir()
    script = scripts / "probe.py"
    shutil.copy(PROBE, script)
    shadow = {"cwd": cwd, "script_dir": scripts, "pythonpath": pp}[place] / f"{SHADOW}.py"
    shadow.write_text("SHADOWED = True\n")
    gate = tmp_path / "gate"
    logs = tmp_path / "logs"
    job = [*BASE, "--max-restarts", "1", str(script)]
    env = {"SHADOW": SHADOW, "PROBE_GATE": str(gate), "PYTHONPATH": f"{pp}:{REPO}"}
    preloaded = rf"standby for local rank 0 preloaded {SHADOW}"
    if standbys == "forked":
        cold_out = tmp_path / "cold"
        cold_out.mkdir()
        await run([*job, str(cold_out), "--log-dir", str(tmp_path / "cold_logs")], env, cwd,
                  None, gate)
        gate.unlink()
        await run([*job[:-1], "--log-dir", str(logs), "--preload", SHADOW, str(script),
                   str(out)], env, cwd, preloaded, gate)
        warm_ranks, cold_file, warm_files = [[0], [0]], cold_out / "r0_0.json", ["r0_0", "r1_0"]
    else:
        await run([*job[:-1], "--log-dir", str(logs), "--preload", SHADOW, str(script),
                   str(out)], env, cwd, preloaded, gate, EMBEDDED)
        warm_ranks, cold_file, warm_files = [None, [0]], out / "r0_0.json", ["r1_0"]
    assert [e.get("warm") for e in events(logs) if e["event"] == "group_started"] \
        == warm_ranks
    cold = json.loads(cold_file.read_text())
    assert SHADOW not in cold["modules_at_start"]
    assert (cold["shadow_file"] == str(shadow)) is (place != "cwd")  # cwd: not on the path
    for name in warm_files:
        warm = json.loads((out / f"{name}.json").read_text())
        assert SHADOW in warm["modules_at_start"]
        assert warm["shadow_file"] == cold["shadow_file"]
        assert warm["path"] == cold["path"]
