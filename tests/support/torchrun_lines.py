"""The torchrun command lines of ``data/torchrun_command_lines.txt``, placeholders filled in.

The lines are kept as torchrun's documentation writes them (``$NUM_TRAINERS``,
``$HOST_NODE_ADDR``...); each known placeholder is replaced by a typical value before the
line is split. Anything else with a ``$`` (``"echo $RANK"``, ``${local_rank}``) stays.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

LINES = Path(__file__).resolve().parent.parent / "data" / "torchrun_command_lines.txt"
PLACEHOLDERS = {
    "NUM_TRAINERS": "4", "NUM_NODES": "2", "MIN_SIZE": "1", "MAX_SIZE": "4",
    "JOB_ID": "job42", "NODE_RANK": "0", "HOST_NODE_ADDR": "node1.example.com:29400",
    "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "ETCD_HOST": "etcd1.example.com",
}


def fill(line: str) -> str:
    return re.sub(r"\$([A-Z_]+)\b", lambda m: PLACEHOLDERS.get(m[1], m[0]), line)


def command_lines() -> list[list[str]]:
    """Every line's arguments (after ``torchrun``), comments and blank lines skipped."""
    lines = [ln for ln in LINES.read_text().splitlines() if ln and not ln.startswith("#")]
    return [shlex.split(fill(ln)) for ln in lines]
