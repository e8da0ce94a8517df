"""A spare takes the place of a node lost from the network or killed, and the node that
comes back waits as a spare: four supervisors, each in its own network namespace on the
test's own bridge, a real etcd reachable only through it (tests/support/netspare.py).

MIN = MAX = 3 plus a spare, lease TTL 3 s, last call 0.5 s, healing on
(``--max-node-failures 2``). A member loses its link (its bridge port down), or its
supervisor is SIGKILLed: the spare is admitted and the new group runs within the bound
below; the node that comes back (link up; a new supervisor with the same node id) ends up
waiting as a spare without disturbing the running group. Nobody is quarantined and no
restart is counted: losing a node is a membership change. Root and ``ip netns`` are
needed (skipped with the reason otherwise).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tests.support import netjob, netspare

logger = logging.getLogger(__name__)

TTL = 3
LAST_CALL = 0.5
LOAD = 2.0  # slack for a loaded 2-core machine: a worker start, a few etcd round trips
# The bound: the lost member's lease expires within a TTL of its last refresh (a
# refresh is due every TTL/3, each bounded by TTL/3), the leader opens the next round at
# once, the round closes when MAX joined (at most a last call); 3 x TTL covers a
# leadership change too (the leader key is bound to the lost leader's lease).
SPARE_BOUND = 3 * TTL + LAST_CALL + LOAD

# timing bounds: one at a time, on one xdist worker of their own (tests/README.md)
pytestmark = [pytest.mark.etcd, pytest.mark.timeout(90), pytest.mark.xdist_group("netns")]


@pytest.fixture(autouse=True)
def _netns() -> None:
    netjob.need_lab(etcdctl=True)


def check_replaced(figures: dict[str, Any]) -> None:
    lost, spares = figures["lost"], figures["spares"]
    # the survivors keep their places and one spare takes the lost node's
    assert figures["survivors_kept"], figures
    admitted = figures["spares_admitted"]
    assert len(admitted) == 1 and admitted[0] in spares, figures
    assert figures["members_after"] == sorted({*"abc", *admitted} - {lost}), figures
    assert figures["same_members_everywhere"], figures
    waiting = ", ".join(spares)
    assert figures["survivor_reasons"] == [f"node(s) lost: {lost}; spare(s) waiting: {waiting}"
                                           ], figures
    assert figures["spare_group_after_loss"] <= SPARE_BOUND, figures
    # the node that came back waits as a spare (so does a spare not admitted), and the
    # job does not notice it
    assert not figures["returned_started_group"], figures
    for status in (figures["returned_status"], *figures["still_spare_status"]):
        assert status is not None and status["spare"] and status["health"] == "spare", figures
        assert status["state"] == "rendezvous", figures
    assert figures["job_undisturbed"], figures
    running = figures["running_status"]
    assert all(s is not None and s["state"] == "running" for s in running), figures
    assert len({s["round"] for s in running}) == 1, figures
    assert not figures["old_workers_alive"], figures
    # a lost node is a membership change: no quarantine, no restart budget
    assert figures["quarantined"] == [], figures
    assert all(s["quarantined"] == [] and s["restarts_used"] == 0 for s in running), figures
    assert figures["failure_restarts"] is None and figures["restart_counts"] == [0], figures


def test_a_member_whose_link_goes_down_is_replaced_by_the_spare_and_waits_when_back() -> None:
    figures = netspare.lose_a_member(how="link", ttl=TTL, last_call=LAST_CALL)
    logger.info("figures: %s", figures)  # the times measured: --log-cli-level=INFO
    check_replaced(figures)
    # its old workers ran on while it was cut from everything (no peer could tell it);
    # back, it learns the job went on without it (its peers say so, or its join key cannot
    # be restored, or it sees the new round): one membership stop, no failure
    assert figures["returned_stops"] == ["membership"], figures
    assert len(figures["returned_changes"]) == 1, figures


def test_a_killed_leader_is_replaced_by_the_spare_and_its_restart_waits_as_a_spare() -> None:
    figures = netspare.lose_a_member(how="kill", ttl=TTL, last_call=LAST_CALL)
    logger.info("figures: %s", figures)
    check_replaced(figures)
    assert figures["lost"] == figures["leader"], figures


def test_with_two_spares_the_survivors_keep_their_places() -> None:
    """Regression: the spares, having no workers to stop, joined the new round before the
    survivors and filled it: a healthy survivor was left out (waiting as a spare) while
    both spares trained (seen with a supervisor restarted at once beside one spare)."""
    figures = netspare.lose_a_member(how="kill", ttl=TTL, last_call=LAST_CALL, spares=2)
    logger.info("figures: %s", figures)
    check_replaced(figures)
