"""A graceful leave told to the peers directly, beside etcd: the rules, as pure logic.

A node that leaves (a stop signal, a quarantine) revokes its lease, and the others see
the leave when etcd commits that: within milliseconds, unless etcd cannot commit anything
for a while, as when its raft leader is cut off (nothing commits until the other members
elect a new leader: 1-3 s at etcd's default election timeout). So the leaving node also
tells up to :data:`NOTIFY` peers of its round directly, on their health endpoints
(``POST /leave-notice``; the ones after it in group-rank order, the peers its cut-off
check asks), and each of them:

1. takes the notice as a hint, nothing more: it names a job, a node and a round, and
   is dropped unless the node is one of the members that tell this one
   (:func:`told_by`) in the round this node runs (:func:`admit`);
2. checks with the named node itself: ``GET /status`` at the health URL this node read
   from etcd (never a URL the notice gives), which must say that the node left that
   round (:func:`confirms_leave`), so a forged notice costs one request and stops nothing;
3. acts only when etcd cannot tell it sooner: if etcd does not serve a linearizable read
   (it has no leader, or this node does not reach it) within :data:`GRACE` seconds of
   the notice, at once; if it does, the leave will come through etcd, with its reasons (a
   spare waiting, a quarantine), and the notice is acted on only if etcd still shows
   nothing :data:`FALLBACK` seconds after it (the leaver's revoke did not reach etcd).
   Acting is the usual membership stop: the workers stop (no restart budget used) and
   the node joins the next round, which forms when etcd commits again.

The body and the peer's answer are untrusted input: anything malformed is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from supervisor.core.partition import peers_to_ask

NOTIFY = 3  # peers told: O(1) requests per leave whatever the job's size
GRACE = 0.5  # s after a notice for etcd to show that it commits (a linearizable read)
FALLBACK = 2.0  # s after a notice when etcd commits but has not shown the leave
MAX_NODE_ID = 256  # characters of a node id in a notice, at most


class LeaveNotice(msgspec.Struct, frozen=True):
    """A node says it left a round (not yet checked)."""

    node: str
    round: int


def notice_body(run_id: str, node: str, round_: int) -> dict[str, object]:
    """The JSON body a leaving node sends."""
    return {"run_id": run_id, "node": node, "round": round_}


def parse_notice(doc: object, run_id: str) -> LeaveNotice | str:
    """The notice in a request's JSON body, or why it is refused."""
    if not isinstance(doc, Mapping):
        return "the body is not a JSON object"
    if doc.get("run_id") != run_id:
        return "not this job's notice"
    node, round_ = doc.get("node"), doc.get("round")
    if not isinstance(node, str) or not 0 < len(node) <= MAX_NODE_ID:
        return "no node id"
    if type(round_) is not int or round_ < 0:
        return "no round"
    return LeaveNotice(node, round_)


def told_by(members: Sequence[str], me: str, count: int = NOTIFY) -> list[str]:
    """The members whose leave this node is told of: those for which it is one of the
    ``count`` peers to ask (:func:`peers_to_ask`), i.e. up to ``count`` members before it
    in group-rank order (wrapping). O(count)."""
    if me not in members:
        return []
    n, i = len(members), list(members).index(me)
    return [members[(i - d) % n] for d in range(1, min(count, n - 1) + 1)]


def tells(members: Sequence[str], me: str, count: int = NOTIFY) -> list[str]:
    """The members this node tells when it leaves (the inverse of :func:`told_by`)."""
    return peers_to_ask(members, me, count) if me in members else []


def admit(notice: LeaveNotice, *, me: str, my_round: int, members: Sequence[str]) -> str | None:
    """Why a well-formed notice is not worth checking (None: check it)."""
    if my_round < 0:
        return "this node runs no round"
    if notice.round != my_round:
        return f"this node runs round {my_round}, not {notice.round}"
    if notice.node not in told_by(members, me):
        return f"{notice.node} is not a member of round {my_round} that tells this node"
    return None


def confirms_leave(doc: object, run_id: str, round_: int) -> bool:
    """Whether a peer's ``/status`` document says it left round ``round_`` of the job."""
    if not isinstance(doc, Mapping) or doc.get("run_id") != run_id:
        return False
    rdzv = doc.get("rendezvous")
    etcd = rdzv.get("etcd") if isinstance(rdzv, Mapping) else None
    left = etcd.get("left_round") if isinstance(etcd, Mapping) else None
    return type(left) is int and left == round_
