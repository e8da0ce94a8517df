"""``--preload`` with ``--no-warm-restart`` (which wins) warns in one line; ``run --help`` names
every ``--nproc-per-node`` word."""

from __future__ import annotations

import logging
import subprocess
import sys

from supervisor.cli import parse_run_args
from supervisor.config import advisories
from supervisor.rendezvous.registry import backend_advisories


def preload_notes(*flags: str) -> list[tuple[int, str]]:
    settings = parse_run_args([*flags, "--preload", "torch", "train.py"], {})
    notes = (*advisories(settings), *backend_advisories(settings))
    return [note for note in notes if note[1].startswith("preload:")]


def test_preload_with_max_restarts_0_on_static_is_quiet() -> None:
    """The first attempt starts in interpreters forked from the fork server: it applies."""
    assert preload_notes("--max-restarts", "0") == []


def test_preload_with_no_warm_restart_warns() -> None:
    ((level, line),) = preload_notes("--max-restarts", "2", "--no-warm-restart")
    assert level == logging.WARNING and "no_warm_restart" in line and "torch" in line


def test_preload_with_restarts_or_an_elastic_backend_is_quiet() -> None:
    assert preload_notes("--max-restarts", "2") == []
    assert preload_notes("--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:2379") == []


def test_run_help_names_gpu_for_nproc_per_node() -> None:
    shown = subprocess.run([sys.executable, "-m", "supervisor", "run", "--help"],
                           capture_output=True, text=True, timeout=30, check=True).stdout
    assert "N, cpu, gpu or auto" in " ".join(shown.split())
