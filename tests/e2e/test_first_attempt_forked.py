"""With ``--preload`` the first attempt starts in standbys forked while the rendezvous
formed: a spare's (when it is admitted) and any node's, as a cold start would see it.

Real daemons on a real etcd; the preload is two small standard-library modules (torch's
figures are in docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from supervisor.core.nodehealth import EXIT_QUARANTINED
from tests.support.etcd import EtcdMember
from tests.support.healing import HealNode, exit_code, healing_job
from tests.support.paths import WORKERS

pytestmark = pytest.mark.etcd

PRELOAD = ["--preload", "colorsys,xml.dom.minidom", "--log-level", "debug"]
PROBE = str(WORKERS / "probe_main.py")
FORKED = r"standby for local rank 0 forked as pid \d+ by the fork server"
# what a warm start and a cold start of the same command must agree on (probe_main.py)
SAME = ("argv", "path0", "path", "main_keys", "stdin", "stdout", "stderr", "own_group",
        "signals", "spawned_child")


def warm_ranks(node: HealNode) -> list[object]:
    return [e.get("warm") for e in node.events("group_started")]


def probe(out: Path, restart: int, node: str) -> dict[str, object]:
    """What ``node``'s worker of ``restart`` recorded (the nodes' ranks are the round's)."""
    for path in out.glob(f"{restart}_*.json"):
        found = json.loads(path.read_text())
        if found["env"].get("HEAL_NODE") == node:
            assert isinstance(found, dict)
            return found
    raise AssertionError(f"no record of {node} for restart {restart}")


async def test_a_spare_admitted_after_a_quarantine_starts_its_first_attempt_warm(
    tmp_path: Path, server: EtcdMember
) -> None:
    flags = ["--max-restarts", "3", "--max-node-failures", "1"]
    async with healing_job(tmp_path, server.endpoint, nnodes="1:1", flags=flags) as job:
        bad = await job.start("n0", bad=True)
        await bad.sup.out.expect(r"^ready 0 n0 world 1 ", timeout=30)
        spare = await job.start("n1", flags=PRELOAD)
        start = spare.sup.err.cursor
        await spare.sup.err.expect("waiting as a spare", timeout=30)
        # while it waits; the fork may be logged before or after that line (a run saw it
        # 3 ms before)
        await spare.sup.err.expect(FORKED, timeout=60, since=start)
        job.bad_gate.touch()
        assert await exit_code(bad, timeout=60) == EXIT_QUARANTINED
        await spare.sup.out.expect(r"^ready 0 n1 world 1 ", timeout=60)
        job.done.touch()
        assert await exit_code(spare, timeout=60) == 0, spare.sup.err.text()
    assert warm_ranks(spare) == [[0]]  # its first attempt ran in the standby
    assert "starts cold" not in spare.sup.err.text()


async def test_the_first_attempt_starts_in_a_standby_forked_while_the_round_forms(
    tmp_path: Path, server: EtcdMember
) -> None:
    """n0 waits for n1 (MIN = 2): its fork server gets ready and forks a standby while the
    rendezvous forms, and its first attempt runs in it, agreeing with n1's cold start (no
    ``--preload``) in everything the warm-start tests compare."""
    out = tmp_path / "out"
    out.mkdir()
    async with healing_job(tmp_path, server.endpoint, nnodes="2:2",
                           flags=["--max-restarts", "1"],
                           worker=[PROBE, str(out)]) as job:
        first = await job.start("n0", flags=PRELOAD)
        await first.sup.err.expect(FORKED, timeout=60)
        second = await job.start("n1")
        assert await exit_code(first, timeout=60) == 0, first.sup.err.text()
        assert await exit_code(second, timeout=60) == 0, second.sup.err.text()
    # one standby, forked before the first launch, served attempt 0
    assert first.sup.err.text().count("for the first attempt while the rendezvous") == 1
    assert warm_ranks(first) == [[0], [0]]
    assert warm_ranks(second)[0] is None  # no --preload: a plain standby for the restart
    warm = probe(out, 0, "n0")
    assert "xml.dom.minidom" in warm["modules"]
    cold = probe(out, 0, "n1")
    assert "xml.dom.minidom" not in cold["modules"]
    for key in SAME:
        assert warm[key] == cold[key], key
