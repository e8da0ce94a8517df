"""``--logs-specs``: torch's default spec means our own log layout; a plugin is refused."""

from __future__ import annotations

import logging
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from supervisor.cli import parse_run_args
from supervisor.config import ConfigError, advisories
from supervisor.torchcompat import DEFAULT_LOGS_SPECS, LOGS_SPECS_GROUP, default_logs_spec_names
from tests.support import deps


def test_default_is_accepted_with_one_info_line() -> None:
    settings = parse_run_args(["--logs_specs=default", "train.py"], {})
    notes = [(level, text) for level, text in advisories(settings) if "logs_specs" in text]
    assert len(notes) == 1 and notes[0][0] == logging.INFO
    assert "our own layout" in notes[0][1]


def test_a_plugin_is_refused_saying_what_to_use_instead() -> None:
    with pytest.raises(ConfigError, match=r"'DOESNOT_EXIST' is not torch's default LogsSpecs.*"
                                          r"use log_dir, redirects, tee"):
        parse_run_args(["--logs-specs", "DOESNOT_EXIST", "train.py"], {})


@pytest.mark.torch
def test_the_names_are_those_torchs_wheel_declares() -> None:
    deps.need_module("torch")
    declared = {ep.name for ep in entry_points(group=LOGS_SPECS_GROUP)
                if ep.value == DEFAULT_LOGS_SPECS}
    assert declared and declared <= default_logs_spec_names()


def test_a_run_with_the_default_spec_logs_where_the_layout_says(tmp_path: Path) -> None:
    """test_run.py::test_is_torchelastic_launched_with_logs_spec_defined, as a user runs it."""
    result = subprocess.run(
        [sys.executable, "-m", "supervisor", "run", "--nnodes=1", "--nproc-per-node=1",
         "--logs_specs=default", "--redirects=3", "--health-port=0", "--rdzv-id=specs",
         f"--log-dir={tmp_path}", "--no-python", sys.executable, "-c", "print('hello')"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "is torch's DefaultLogsSpecs" in result.stderr
    logs = list(tmp_path.glob("specs/attempt_*/0/stdout.log"))
    assert len(logs) == 1 and logs[0].read_text() == "hello\n"
