"""NUMA binding through the real daemon: each worker runs on the CPUs computed from this
machine's sysfs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from supervisor.core.numa import NumaBindingError, bind_ranks
from supervisor.workers.topology import read_topology
from tests.support.daemon import supervisor
from tests.support.paths import WORKERS

REPORT_AFFINITY = (WORKERS / "report_affinity.py").read_text()


@pytest.mark.parametrize("mode", ["node", "exclusive"])
async def test_daemon_binds_workers_as_computed_from_real_sysfs(
    tmp_path: Path, mode: str
) -> None:
    nproc = 2
    allowed = frozenset(os.sched_getaffinity(0))
    try:
        expected = bind_ranks(read_topology("/"), mode, nproc, allowed=allowed)
    except NumaBindingError as exc:
        pytest.skip(f"this machine cannot bind {nproc} ranks in mode {mode}: {exc}")
    script = tmp_path / "affinity.py"
    script.write_text(REPORT_AFFINITY)
    out = tmp_path / "out"
    out.mkdir()
    args = ["--health-port", "0", "--numa-binding", mode, "--nproc-per-node", str(nproc),
            "--log-dir", str(tmp_path / "logs"), str(script), str(out)]
    async with supervisor(args) as sup:
        assert await sup.wait() == 0
    seen = [tuple(json.loads((out / f"{r}.json").read_text())) for r in range(nproc)]
    assert seen == expected
    events = (tmp_path / "logs" / "none" / "events.jsonl").read_text().splitlines()
    started = next(e for e in map(json.loads, events) if e["event"] == "group_started")
    assert started["cpus"] == {str(r): list(cpu_set) for r, cpu_set in enumerate(expected)}
