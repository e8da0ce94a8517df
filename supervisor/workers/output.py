"""Where worker output goes: the console (inherited) or per-rank files.

``LOG_DIR/RUN_ID/attempt_K/LOCAL_RANK/{stdout.log,stderr.log}`` as torchrun lays them out.
``--redirects``/``--tee`` take torchrun's values: 0 none, 1 stdout, 2 stderr, 3 both, or a
per-rank map such as ``0:1,1:3``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path


class OutputSpecError(ValueError):
    pass


def parse_std_map(text: str, local_world_size: int, *, what: str) -> dict[int, int]:
    """``"3"`` or ``"0:1,1:3"`` -> {local_rank: 0..3} for every local rank."""
    text = text.strip()
    if re.fullmatch(r"\d+", text):
        value = int(text)
        if value > 3:
            raise OutputSpecError(f"{what}: expected 0-3, got {text!r}")
        return dict.fromkeys(range(local_world_size), value)
    result = dict.fromkeys(range(local_world_size), 0)
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d+)\s*:\s*(\d+)", part)
        if not m or int(m.group(2)) > 3:
            raise OutputSpecError(f"{what}: expected 0-3 or RANK:0-3,..., got {text!r}")
        result[int(m.group(1))] = int(m.group(2))
    return result


class OutputPlan:
    """Opens each rank's output files; the worker writes to them directly."""

    def __init__(self, redirects: str, tee: str, local_world_size: int) -> None:
        self.redirects = parse_std_map(redirects, local_world_size, what="redirects")
        tee_map = parse_std_map(tee, local_world_size, what="tee")
        # without pipes, tee degrades to a redirect of the same streams
        self.to_file = {r: self.redirects[r] | tee_map[r] for r in self.redirects}
        self._open: dict[int, list[int]] = {}

    def open_rank(
        self, dir_index: int, rank_dir: Path, local_rank: int, global_rank: int
    ) -> tuple[int | None, int | None]:
        mask = self.to_file.get(local_rank, 0)
        fds: list[int] = []
        out = err = None
        if mask & 1:
            out = _open_log(rank_dir / "stdout.log")
            fds.append(out)
        if mask & 2:
            err = _open_log(rank_dir / "stderr.log")
            fds.append(err)
        self._open[local_rank] = fds
        return out, err

    def after_spawn(self, local_rank: int) -> None:
        for fd in self._open.pop(local_rank, []):
            os.close(fd)

    def reopen(self) -> None:
        return None

    async def drain(self, dir_index: int) -> None:
        return None


def _open_log(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640)
