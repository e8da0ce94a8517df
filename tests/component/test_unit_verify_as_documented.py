"""``systemd-analyze verify`` as docs/deploy.md tells a user to run it: the shipped unit's
only complaint is the not yet installed binary, and the documented check passes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support import deps
from tests.support.paths import REPO as _REPO

REPO = _REPO
BINARY = "/opt/elastic-supervisor/venv/bin/elastic-supervisor"


def documented_check() -> str:
    text = (REPO / "docs" / "deploy.md").read_text()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("d=$(mktemp -d) && sed ")]
    return line


def test_the_shipped_unit_only_lacks_the_installed_binary() -> None:
    analyze = deps.need_binary("systemd-analyze", "apt-get install systemd")
    if os.path.exists(BINARY):
        pytest.skip(f"{BINARY} is installed here: nothing is missing to complain about")
    result = subprocess.run([analyze, "verify", "--man=no", "systemd/elastic-supervisor.service"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.stderr.strip().splitlines() == [
        f"elastic-supervisor.service: Command {BINARY} is not executable: No such file or "
        "directory"]


def test_the_documented_check_passes_silently(tmp_path: Path) -> None:
    deps.need_binary("systemd-analyze", "apt-get install systemd")
    result = subprocess.run(["bash", "-c", documented_check()], cwd=REPO,
                            env={**os.environ, "TMPDIR": str(tmp_path)},
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    assert [p.name for p in tmp_path.rglob("*.service")] == ["elastic-supervisor.service"]
