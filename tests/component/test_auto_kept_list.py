"""``--preload auto``'s list kept in the run directory for the next run: written whole,
read as untrusted input (a worker can reach the run directory)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from supervisor.workers.warm import autopreload
from supervisor.workers.warm.autopreload import KEPT_NAME, MAX_RECORD


def test_a_kept_list_is_read_back_as_written(tmp_path: Path) -> None:
    autopreload.keep(tmp_path, ["torch", "torch._dynamo", "numpy"], {"wandb"})
    assert autopreload.read_kept(tmp_path) == (["torch", "torch._dynamo", "numpy"], {"wandb"})
    assert [p.name for p in tmp_path.iterdir()] == [KEPT_NAME]  # no temporary file left
    assert (tmp_path / KEPT_NAME).stat().st_mode & 0o077 == 0


def test_no_kept_list_means_nothing_learned_yet(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    assert autopreload.read_kept(tmp_path) == ([], set())
    assert not caplog.records


@pytest.mark.parametrize("content", [
    b"not json", b"[" * 100_000, b'["torch"]', b"\xff\xfe", b'{"names": "torch"}',
])
def test_a_malformed_kept_list_is_ignored_with_one_warning(
        tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / KEPT_NAME).write_bytes(content)
    assert autopreload.read_kept(tmp_path) == ([], set())
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) <= 1


def test_names_that_are_not_module_names_are_dropped(tmp_path: Path) -> None:
    doc = {"names": ["torch", "../etc/passwd", "os; rm -rf /", 7, "", "a" * 300, "torch"],
           "exclude": ["wandb", None, "x-y"]}
    (tmp_path / KEPT_NAME).write_text(json.dumps(doc))
    assert autopreload.read_kept(tmp_path) == (["torch"], {"wandb"})


def test_a_symlink_or_an_oversized_file_is_not_read(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"names": ["torch"]}))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.symlink(target, run_dir / KEPT_NAME)
    assert autopreload.read_kept(run_dir) == ([], set())
    (run_dir / KEPT_NAME).unlink()
    (run_dir / KEPT_NAME).write_text(json.dumps({"names": ["torch"], "pad": "x" * MAX_RECORD}))
    assert autopreload.read_kept(run_dir) == ([], set())


def test_a_list_that_cannot_be_written_is_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    missing = tmp_path / "gone"
    autopreload.keep(missing, ["torch"], set())
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "cannot keep --preload auto's list" in caplog.text
