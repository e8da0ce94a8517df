"""Reading a supervisor's ``events.jsonl`` while it may still be writing it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_events(path: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The records of ``path`` (all, or those of event ``kind``); none if it is not there.
    A line that does not parse is the last one, being written right now: skipped."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    found = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if kind is None or record.get("event") == kind:
            found.append(record)
    return found


def warm_ranks(log_dir: Path, run_id: str = "none") -> list[Any]:
    """Per attempt (``group_started``, in order), the local ranks that started warm (None:
    every rank started cold), from ``LOG_DIR/RUN_ID/events.jsonl``."""
    return [e.get("warm") for e in read_events(log_dir / run_id / "events.jsonl",
                                               "group_started")]
