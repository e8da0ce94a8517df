"""The ``--snapshot-dir`` layout and what a run may trust in it: pure, no I/O.

    DIR/manifest.json              {"format": 1, "run_id": ..., "world_size": W}
    DIR/step_<S>/node<G>/rank<R>.pt   one per global rank (replicated: node<G>/node.pt)
    DIR/step_<S>/node<G>/part.json    node G's part is whole: {"format": 1, "step": S,
                                   "world_size": W, "nodes": N, "replicated": bool,
                                   "files": {"<key>": "node<G>/rank<R>.pt"}}
    DIR/step_<S>/complete.json     the job-wide marker: every node's part is there
                                   {"format": 1, "step": S, "world_size": W,
                                    "replicated": bool, "files": {"<key>": "node0/rank0.pt"}}

Over several nodes each node writes its own ranks' files and its part; whichever node
sees every part of a step (``merge``) writes the job-wide marker, the same bytes whoever
writes it. A replicated step has one part, group rank 0's (``nodes`` 1).

Every ``.pt`` file is a snapshot's bytes as kept in memory: a ``torch.save`` file. A step
is complete in DIR only once its marker is there (written last, atomically). A manifest
or a marker that does not parse, or names a path outside its step's directory, is
refused with one line: nothing in DIR is trusted beyond what these functions accept.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, TypeGuard

FORMAT = 1
MANIFEST = "manifest.json"
MARKER = "complete.json"
PART = "part.json"
KEEP = 2  # complete steps kept in DIR
_STEP_DIR = re.compile(r"step_(\d{1,18})")
_FILE = re.compile(r"node\d{1,9}/(rank\d{1,9}|node)\.pt")


@dataclass(frozen=True)
class Manifest:
    run_id: str
    world_size: int

    def encode(self) -> bytes:
        return json.dumps({"format": FORMAT, "run_id": self.run_id,
                           "world_size": self.world_size}).encode()


@dataclass(frozen=True)
class Marker:
    step: int
    world_size: int
    replicated: bool
    files: dict[int, str]  # key (global rank, or -1 replicated) -> path below step_<S>/

    def encode(self) -> bytes:
        return json.dumps({"format": FORMAT, "step": self.step, "world_size": self.world_size,
                           "replicated": self.replicated,
                           "files": {str(k): v for k, v in self.files.items()}}).encode()


@dataclass(frozen=True)
class Part:
    """Node ``group_rank``'s part of a step: its files are written and synced."""

    step: int
    group_rank: int
    nodes: int  # parts the step needs (the round's node count; 1 when replicated)
    world_size: int
    replicated: bool
    files: dict[int, str]

    def encode(self) -> bytes:
        return json.dumps({"format": FORMAT, "step": self.step, "group_rank": self.group_rank,
                           "nodes": self.nodes, "world_size": self.world_size,
                           "replicated": self.replicated,
                           "files": {str(k): v for k, v in self.files.items()}}).encode()


def part_name(group_rank: int) -> str:
    return f"node{group_rank}/{PART}"


def parse_part(data: bytes, step: int, group_rank: int) -> Part | None:
    """Node ``group_rank``'s part of ``step``, or None if it is not one (its files must
    be in its own directory)."""
    doc = _json(data)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("step") != step \
            or doc.get("group_rank") != group_rank:
        return None
    nodes, world, replicated, files = (doc.get("nodes"), doc.get("world_size"),
                                       doc.get("replicated"), doc.get("files"))
    if not (_positive(nodes) and _positive(world) and isinstance(replicated, bool)
            and isinstance(files, dict) and files):
        return None
    parsed: dict[int, str] = {}
    for key, path in files.items():
        if not (isinstance(key, str) and re.fullmatch(r"-1|\d{1,9}", key)
                and isinstance(path, str) and _FILE.fullmatch(path)
                and path.startswith(f"node{group_rank}/")):
            return None
        parsed[int(key)] = path
    return Part(step, group_rank, nodes, world, replicated, parsed)


def merge(parts: Iterable[Part]) -> Marker | None:
    """The job-wide marker of a step whose parts are all there and agree (every group
    rank ``0..nodes-1``, one world size, every rank's file), else None."""
    found = {p.group_rank: p for p in parts}
    first = found.get(0)
    if first is None or set(found) != set(range(first.nodes)):
        return None
    shape = (first.step, first.nodes, first.world_size, first.replicated)
    if any((p.step, p.nodes, p.world_size, p.replicated) != shape for p in found.values()):
        return None
    files = {k: v for p in found.values() for k, v in p.files.items()}
    wanted = {-1} if first.replicated else set(range(first.world_size))
    if set(files) != wanted:
        return None
    return Marker(first.step, first.world_size, first.replicated, dict(sorted(files.items())))


def step_dir(step: int) -> str:
    return f"step_{step}"


def file_name(group_rank: int, key: int) -> str:
    owner = "node" if key < 0 else f"rank{key}"
    return f"node{group_rank}/{owner}.pt"


def node_of(name: str) -> int | None:
    """The group rank of a ``node<G>`` directory name, else None."""
    m = re.fullmatch(r"node(\d{1,9})", name)
    return int(m.group(1)) if m else None


def step_of(name: str) -> int | None:
    """The step of a ``step_<S>`` directory name, else None."""
    m = _STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def parse_manifest(data: bytes) -> Manifest | str:
    """The manifest, or why it is refused."""
    doc = _json(data)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return f"not a format {FORMAT} manifest"
    run_id, world_size = doc.get("run_id"), doc.get("world_size")
    if not isinstance(run_id, str) or not _positive(world_size):
        return "its run_id or world_size is missing or malformed"
    return Manifest(run_id, world_size)


def parse_marker(data: bytes, step: int) -> Marker | str:
    """The marker of ``step_<step>``, or why it is refused (a path outside the step's
    directory is refused: only ``node<G>/rank<R>.pt`` and ``node<G>/node.pt`` are files)."""
    doc = _json(data)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("step") != step:
        return f"not the format {FORMAT} marker of step {step}"
    world_size, replicated, files = doc.get("world_size"), doc.get("replicated"), doc.get("files")
    if not _positive(world_size):
        return "its world_size is missing or malformed"
    if not isinstance(replicated, bool) or not isinstance(files, dict) or not files:
        return "its replicated flag or files are missing or malformed"
    parsed: dict[int, str] = {}
    for key, path in files.items():
        if not isinstance(key, str) or not re.fullmatch(r"-1|\d{1,9}", key):
            return f"a file key is malformed: {key!r}"
        if not isinstance(path, str) or not _FILE.fullmatch(path) or ".." in PurePosixPath(
                path).parts:
            return f"it names a path outside its step's directory: {path!r}"
        parsed[int(key)] = path
    wanted = {-1} if replicated else set(range(world_size))
    if set(parsed) != wanted:
        return "its files do not cover every rank"
    return Marker(step, world_size, replicated, parsed)


def to_prune(complete: Iterable[int], present: Iterable[int]) -> list[int]:
    """Step directories to remove: everything older than the ``KEEP`` newest complete
    steps (incomplete ones newer than those stay: one may be being written)."""
    kept = sorted(complete)[-KEEP:]
    if len(kept) < KEEP:
        return []
    return sorted(s for s in present if s < kept[0])


def _json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None


def _positive(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
