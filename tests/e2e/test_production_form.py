"""The production form: ``--no-python`` naming the job's own venv interpreter (``VENV/bin/
python -u job.py``, as config/single-node.toml and config/etcd-multinode.toml run it). The
fork server and the standbys run that interpreter, with its own site-packages (here a
package the supervisor's venv lacks, and a ``supervisor`` package of its own, which must
never be imported); where that cannot apply, one warning at start and cold starts.

The job's venv is made by the test (``python -m venv --without-pip``: about a second)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.daemon import supervisor
from tests.support.eventlog import warm_ranks

BASE = ["--health-port", "0", "--shutdown-timeout", "5", "--log-level", "debug",
        "--max-restarts", "1"]
JOB = '''
import json, os, sys
at_start = sorted(sys.modules)
import jobonly
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
with open(os.path.join(sys.argv[1], f"{restart}.json"), "w") as f:
    json.dump({"at_start": at_start, "prefix": sys.prefix, "jobonly": jobonly.__file__,
               "supervisor": "supervisor" in sys.modules}, f)
sys.exit(1 if restart == "0" else 0)
'''


def job_venv(tmp_path: Path) -> Path:
    """A venv with ``jobonly`` (absent from ours) and a ``supervisor`` that fails if
    imported; its interpreter."""
    venv = tmp_path / "jobvenv"
    done = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)],
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        pytest.skip(f"cannot make a venv (apt-get install python3-venv): {done.stderr}")
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "jobonly").mkdir()
    (site / "jobonly" / "__init__.py").write_text("VALUE = 1\n")
    (site / "supervisor").mkdir()
    (site / "supervisor" / "__init__.py").write_text(
        "raise ImportError('the job venv\\'s own supervisor package was imported')\n")
    return venv / "bin" / "python"


async def test_the_fork_server_runs_the_job_venv_interpreter(tmp_path: Path) -> None:
    python = job_venv(tmp_path)
    assert subprocess.run([sys.executable, "-c", "import jobonly"],
                          capture_output=True).returncode != 0  # not in our venv
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    (tmp_path / "job.py").write_text(JOB)
    args = [*BASE, "--log-dir", str(logs), "--preload", "jobonly", "--no-python",
            str(python), "-u", str(tmp_path / "job.py"), str(out)]
    async with supervisor(args, cwd=tmp_path) as sup:
        assert await sup.wait(timeout=60) == 0, sup.err.text()
    assert "preload: no effect" not in sup.err.text()
    assert warm_ranks(logs) == [[0], [0]]
    for restart in range(2):
        record = json.loads((out / f"{restart}.json").read_text())
        assert "jobonly" in record["at_start"]  # preloaded by the job venv's server
        assert record["prefix"] == str(python.parent.parent)
        assert record["jobonly"].startswith(record["prefix"])
        assert not record["supervisor"]


FAKE_OLD_PYTHON = """#!/bin/sh
# answers the supervisor's version probe as an old CPython would; runs the real one else
case "$*" in *version_info*) echo cpython 3 9; exit 0;; esac
exec {python} "$@"
"""


@pytest.mark.parametrize("command", ["sh", "old"])
async def test_where_it_cannot_apply_one_warning_and_cold_starts(
        tmp_path: Path, command: str) -> None:
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    (tmp_path / "job.py").write_text(JOB.replace("import jobonly", "jobonly = os"))
    if command == "sh":
        head, why = ["/bin/sh", "-c", f'exec "{sys.executable}" -u "$0" "$@"'], \
            "is not a Python interpreter"
    else:
        old = tmp_path / "python3.9"
        old.write_text(FAKE_OLD_PYTHON.format(python=sys.executable))
        old.chmod(0o755)
        head, why = [str(old), "-u"], "standbys need CPython 3.10 or later"
    args = [*BASE, "--log-dir", str(logs), "--preload", "json", "--no-python", *head,
            str(tmp_path / "job.py"), str(out)]
    async with supervisor(args, cwd=tmp_path) as sup:
        assert await sup.wait(timeout=60) == 0, sup.err.text()
    text = sup.err.text()
    assert text.count("preload: no effect, every attempt starts cold") == 1
    assert why in text
    assert warm_ranks(logs) == [None, None]
