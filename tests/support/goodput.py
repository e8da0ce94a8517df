"""The goodput test worker and reading what it logged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.support.paths import WORKERS

WORKER = str(WORKERS / "goodput_worker.py")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSON-lines file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def first_posts(worker_log: list[dict[str, Any]], attempt: int) -> dict[int, float]:
    """Each rank's first deadline post in ``attempt`` (wall time), from the worker's log."""
    firsts: dict[int, float] = {}
    for rec in worker_log:
        if rec["event"] == "post" and rec["attempt"] == attempt:
            firsts.setdefault(rec["rank"], rec["t"])
    return firsts
