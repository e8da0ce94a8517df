"""A full job loses a member and the spare takes its place, each node in its own network
namespace (``tests.support.netjob``: etcd reachable only via the lab's bridge).

Nodes a, b, c form a ``3:3`` job (etcd backend, distinct node ids, healing on); d (and e)
start last and wait as spares. One member is lost, by setting its bridge port down (cut from
etcd and from every peer at once) or by SIGKILLing its supervisor (its workers die by
their death signal); then it comes back (the link up again, or a new supervisor on the
same node with the same node id). Figures, read from the nodes' event logs and etcd: how
long from the loss to the new group (the spare included) running, how the node that came
back ended up, and whether the running job noticed it at all.

Shared by ``tests/e2e/test_spare_replaces_lost_node_netns.py``; ``code`` and ``keep`` as
in ``netjob``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tests.support.netjob import Job, Node, job, wait_for
from tests.support.paths import REPO
from tests.support.processes import pid_alive

HEAL = ("--max-restarts", "3", "--max-node-failures", "2")  # healing on: quarantines possible
MEMBERS = "abc"
SPARES = "de"


def lose_a_member(*, how: str, ttl: int, last_call: float, spares: int = 1,
                  code: Path = REPO, keep: Path | None = None) -> dict[str, Any]:
    """``how``: ``"link"`` (a member that is not the leader loses its link, which comes
    back once the spare's group runs) or ``"kill"`` (the leader's supervisor is
    SIGKILLed, then started again on its node). ``spares``: how many wait (d, e)."""
    assert how in ("link", "kill") and 1 <= spares <= len(SPARES), (how, spares)
    with job(ttl=ttl, code=code, keep=keep) as j:
        j.start_etcd(1)
        members = [start(j, label, last_call) for label in MEMBERS]
        j.wait_group(members, 3)
        waiting = [start(j, label, last_call) for label in SPARES[:spares]]
        for spare in waiting:
            wait_for(f"{spare.host.label} waiting as a spare",
                     lambda spare=spare: spare.first("spare_waiting", 0.0), 60)
        leader = j.etcd_get("ctl/leader")["node"]
        lost = next(n for n in members if (n.host.label == leader) == (how == "kill"))
        survivors = [n for n in members if n is not lost]
        old_pids = lost.pids()

        lost_at = time.monotonic()
        if how == "link":
            j.lab.link_down(lost.host)
        else:
            lost.proc.kill()
            lost.proc.wait()
        group = [j.nodes[x] for x in next_round([*survivors, *waiting], lost_at, ttl)]
        running = j.wait_group(group, 3, after=lost_at, timeout=max(60, 10 * ttl))
        ran_on = {n.host.label: n.pids() for n in group}
        still_spare = [n for n in waiting if n not in group]

        back_at = time.monotonic()
        if how == "link":
            j.lab.link_up(lost.host)
            returned = lost
        else:
            returned = start(j, lost.host.label, last_call, lost=lost)
        back = float(wait_for("the node that came back waiting as a spare",
                              lambda: returned.first("spare_waiting", back_at), 60))
        wait_for("old workers gone", lambda: not any(pid_alive(p) for p in old_pids), 30)
        # what the running job does about a new spare it cannot admit: nothing, for a lease
        # TTL and a last call (the leader's next look at its wait key) and then some
        wait_for("the watch window", lambda: time.monotonic() - back >= ttl + last_call + 1,
                 ttl + last_call + 10)
        return {
            "how": how, "ttl": ttl, "last_call_timeout": last_call, "lost": lost.host.label,
            "leader": leader, "spares": [n.host.label for n in waiting],
            "spare_group_after_loss": running - lost_at,
            "members_after": sorted(n.host.label for n in group),
            "survivors_kept": all(n in group for n in survivors),
            "spares_admitted": sorted(n.host.label for n in waiting
                                      if n.first("spare_admitted", lost_at)),
            "same_members_everywhere": len({tuple(last_members(n)) for n in group}) == 1,
            "returned_waiting_after": back - back_at,
            "returned_started_group": returned.first("group_started", back_at) is not None,
            "returned_stops": [e.get("reason") for e in returned.events("group_stopping")
                               if float(e["mono"]) > lost_at],
            "returned_changes": [e["reason"] for e in returned.events("membership_changed")
                                 if float(e["mono"]) > lost_at],
            "old_workers_alive": sorted(p for p in old_pids if pid_alive(p)),
            "returned_status": status_of(returned),
            "still_spare_status": [status_of(n) for n in still_spare],
            "running_status": [status_of(n) for n in group],
            "survivor_reasons": sorted({e["reason"] for n in survivors
                                        for e in n.events("membership_changed")
                                        if float(e["mono"]) > lost_at}),
            "job_undisturbed": undisturbed(group, running, ran_on),
            "quarantined": sorted({e.get("node", n.host.label) for n in j.nodes.values()
                                   for e in n.events("node_quarantined")}),
            "failure_restarts": j.etcd_get("ctl/restarts"),
            "restart_counts": sorted({int(e["restart_count"]) for n in group
                                      for e in n.events("group_started")}),
        }


def next_round(nodes: list[Node], after: float, ttl: int) -> list[str]:
    """The members of the first round any of ``nodes`` completed after ``after``."""
    def members() -> list[str] | None:
        for node in nodes:
            rounds = [e for e in node.events("rendezvous") if float(e["mono"]) > after]
            if rounds:
                return [str(m) for m in rounds[0]["members"]]
        return None
    return list(wait_for("the next round", members, max(60, 10 * ttl)))


def start(j: Job, label: str, last_call: float, lost: Node | None = None) -> Node:
    """Node ``label`` of the 3:3 job (again on ``lost``'s namespace when given)."""
    return j.start_node(label, nnodes="3:3", flags=HEAL,
                        conf=f"node_id={label},last_call_timeout={last_call:g}",
                        host=lost.host if lost is not None else None)


def status_of(node: Node) -> dict[str, Any] | None:
    """What its ``/status`` says about its place in the job."""
    status = node.status()
    if status is None:
        return None
    health = status.get("node_health") or {}
    return {"state": status["state"], "round": status["rendezvous"]["round"],
            "restarts_used": status["restarts"]["used"], "spare": health.get("spare"),
            "health": health.get("state"),
            "quarantined": (health.get("job") or {}).get("quarantined")}


def last_members(node: Node) -> list[str]:
    rounds = node.events("rendezvous")
    return sorted(rounds[-1]["members"]) if rounds else []


def undisturbed(nodes: list[Node], since: float, pids: dict[str, set[int]]) -> bool:
    """No node of the running group saw a membership change, a new round or a new group
    after ``since``, and each still runs the workers it ran then."""
    changes = ("membership_changed", "rendezvous", "group_stopping", "group_started")
    return all(n.first(kind, since) is None for n in nodes for kind in changes) and all(
        n.pids() == pids[n.host.label] for n in nodes)
