"""The fork server's and the forked standbys' memory in /metrics, sampled off the loop."""

from __future__ import annotations

import os
import subprocess
import sys

from supervisor.health.metrics import Metrics
from supervisor.workers.warm.memory import MemorySample, rss_bytes, sample, uss_bytes


def test_a_sample_reads_rss_and_uss_of_real_processes() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == b"up\n"  # running Python, not still in exec
        child.stdout.close()
        taken = sample(os.getpid(), {0: child.pid, 1: 2 ** 22 + 7})  # the last: no such pid
        assert taken.server_rss is not None and taken.server_rss > 1 << 20
        assert set(taken.standby_uss) == {0}
        assert 0 < taken.standby_uss[0] < (rss_bytes(child.pid) or 0)
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(30)
    assert uss_bytes(child.pid) is None  # reaped: gone


class _Pool:
    def memory(self) -> MemorySample | None:
        return MemorySample(1.0, 300 << 20, {0: 3 << 20, 1: 4 << 20})

    def fork_failures(self) -> dict[str, int]:
        return {"died": 2}


def test_metrics_show_the_last_sample_and_the_failures() -> None:
    metrics = Metrics(started=0.0)
    metrics.watch_warm(_Pool())
    text = metrics.render().decode()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#")
    assert float(values["elastic_supervisor_fork_server_rss_bytes"]) == 300 << 20
    assert float(values['elastic_supervisor_standby_uss_bytes{local_rank="1"}']) == 4 << 20
    assert 'elastic_supervisor_fork_server_failures_total{reason="died"} 2.0' in text
