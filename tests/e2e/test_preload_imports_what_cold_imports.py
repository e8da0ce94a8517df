"""``--preload`` imports what the cold command would import (a module that shadows the
preloaded one in the working directory, the script's directory or a PYTHONPATH entry is
found, or not, as by a cold start), for started and for forked standbys alike."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.support.daemon import supervisor
from tests.support.paths import REPO, WORKERS

PROBE = WORKERS / "fork_probe.py"
BASE = ["--health-port", "0", "--shutdown-timeout", "5", "--log-level", "debug"]
SHADOW = "colorsys"  # a stdlib module nobody imports at start-up


def events(log_dir: Path) -> list[dict[str, object]]:
    path = log_dir / "none" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("standbys", ["forked", "started"])
@pytest.mark.parametrize("place", ["cwd", "script_dir", "pythonpath"])
async def test_the_preload_finds_the_module_the_cold_start_finds(
        tmp_path: Path, place: str, standbys: str) -> None:
    scripts, cwd, pp, out = (tmp_path / n for n in ("scripts", "cwd", "pp", "out"))
    for d in (scripts, cwd, pp, out):
        d.mkdir()
    script = scripts / "probe.py"
    shutil.copy(PROBE, script)
    shadow = {"cwd": cwd, "script_dir": scripts, "pythonpath": pp}[place] / f"{SHADOW}.py"
    shadow.write_text("SHADOWED = True\n")
    gate = tmp_path / "gate"
    logs = tmp_path / "logs"
    args = [*BASE, "--max-restarts", "1", "--log-dir", str(logs), "--preload", SHADOW,
            "--preload-after", "0", *(["--no-fork-server"] if standbys == "started" else []),
            str(script), str(out)]
    env = {"SHADOW": SHADOW, "PROBE_GATE": str(gate), "PYTHONPATH": f"{pp}:{REPO}"}
    async with supervisor(args, env=env, cwd=cwd) as sup:
        await sup.err.expect(rf"standby for local rank 0 preloaded {SHADOW}", timeout=60)
        gate.touch()
        assert await sup.wait() == 0
    assert [e.get("warm") for e in events(logs) if e["event"] == "group_started"] == [None, [0]]
    cold = json.loads((out / "r0_0.json").read_text())
    warm = json.loads((out / "r1_0.json").read_text())
    assert SHADOW not in cold["modules_at_start"] and SHADOW in warm["modules_at_start"]
    assert warm["shadow_file"] == cold["shadow_file"]
    assert (cold["shadow_file"] == str(shadow)) is (place != "cwd")  # cwd: not on the path
    assert warm["path"] == cold["path"]
