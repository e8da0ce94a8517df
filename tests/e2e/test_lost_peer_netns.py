"""A lost peer costs no restart, across network namespaces (issue 53, item 2): nodes a and
b and one etcd, each in its own namespace on the test's bridge (``tests.support.netjob``),
fake workers linked to rank 0 over TCP (``fake_worker.py --link``: a collective's
connections). Node b is lost:

- its supervisor is SIGKILLed (its workers die with it): a's rank 0 fails on the broken
  link at once, and a's check finds b's health endpoint refusing connections (the host is
  up, nothing listens): a membership change, named in the log;
- its bridge port goes down: nothing answers and nothing breaks, a's rank hangs in its
  "collective" (as gloo's and NCCL's do, for far longer than a lease); b's lease expires
  and etcd's membership change stops a's group: again no budget, and b named.

Either way a's budget is untouched (no restart scheduled, ``ctl/restarts`` absent) and a
runs on alone. Root and ``ip netns`` are needed (skipped with the reason otherwise).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support import netjob
from tests.support.netjob import Node, wait_for

TTL = 3
pytestmark = [pytest.mark.etcd, pytest.mark.timeout(120), pytest.mark.xdist_group("netns")]
FLAGS = ("--max-restarts", "3", "--redirects", "3")  # worker output in files: "linked N"


@pytest.fixture(autouse=True)
def _netns() -> None:
    netjob.need_lab(etcdctl=True)


def linked(node: Node) -> bool:
    """Its worker of the first attempt linked to rank 0 (it printed ``linked N``)."""
    logs = (node.log_dir / node.run_id).glob("attempt_*/0/stdout.log")
    return any("linked" in log.read_text() for log in logs)


@pytest.mark.parametrize("how", ["kill", "link"])
def test_a_lost_peer_costs_no_restart_and_is_named(how: str, tmp_path: Path) -> None:
    with netjob.job(ttl=TTL, keep=tmp_path) as j:
        j.start_etcd(1)
        a, b = (j.start_node(x, nnodes="1:2", conf="node_id=" + x, flags=FLAGS,
                             worker=("--link",)) for x in "ab")
        j.wait_group([a, b], 2)
        wait_for("both workers linked", lambda: linked(a) and linked(b), 30)
        lost_at = time.monotonic()
        if how == "kill":
            b.proc.kill()
            b.proc.wait()
        else:
            j.lab.link_down(b.host)
        j.wait_group([a], 1, after=lost_at, timeout=10 * TTL)
        assert not a.events("restart_scheduled"), a.events("restart_scheduled")
        assert j.etcd_get("ctl/restarts") is None
        stderr = (j.root / "a.stderr").read_text()
        if how == "kill":
            (event,) = a.events("peer_lost")
            assert list(event["nodes"]) == ["b"] and event["budget_used"] is False
            assert f"node b (its health endpoint at http://{b.host.addr}:" in stderr
            assert "a membership change, no restart used" in stderr
        else:  # nothing broke before the lease expired: etcd said so, naming b
            reasons = [e["reason"] for e in a.events("membership_changed")
                       if float(e["mono"]) > lost_at]
            assert reasons and reasons[0].startswith("node(s) lost: b"), reasons
        status = a.status()
        assert status is not None and status["restarts"]["used"] == 0, status
        assert status["goodput"]["last_recovery"]["cause"] == "node_lost", status["goodput"]
