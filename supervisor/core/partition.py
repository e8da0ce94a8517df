"""Is this node the one cut off from etcd? The rule, as pure logic (no I/O, no clock).

A node that cannot reach etcd cannot tell on its own whether etcd is down for everyone
(ride it out: membership cannot change, the workers run on) or only it is cut off (the
others see its lease expire and re-form without it: its workers must stop, or two groups
of one job run at once). Its peers can tell it. While etcd does not answer, the node asks
the peers of its round (their health endpoints' ``/status``) and feeds what they said to
:func:`judge`:

1. No peer answers: it cannot tell a cut-off from a cluster-wide outage: **ride out**.
2. A peer runs a newer round than this node: the job went on without it: **stop now**.
3. Some answering peer reaches etcd: etcd is up, so this node is the one cut off; its
   lease expires at the latest ``ttl + max_rtt`` after its last refresh was sent, and the
   others re-form only after that: **stop once that time has passed** (wait until then).
   Right after an outage for everyone, every lease expired and the others wait one TTL
   for the keys to come back: the clock then starts when the outage ended
   (:func:`standing_since`), so a blip just after it stops nothing. A node still inside
   that outage learns its end from the peers: a witness that says it reaches etcd again
   since ``recovered_for`` seconds gives this node one TTL from then too (else the first
   peer to reconnect would stop the nodes that had not yet).
4. Every answering peer says it cannot reach etcd either: a cluster-wide outage:
   **ride out**.

A peer's answer is untrusted input: :func:`parse_peer_status` turns anything that is not a
well-formed status document of the same job into "did not answer".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any


class Cutoff(Enum):
    RIDE_OUT = "ride_out"  # keep the workers: etcd may be down for everyone
    WAIT = "wait"  # cut off, but the lease may not have expired yet: look again at ``until``
    STOP = "stop"  # cut off and out of the job: stop the workers, join the next round


@dataclass(frozen=True)
class PeerReport:
    """What one peer's health endpoint said (``answered=False``: nothing usable)."""

    node: str
    answered: bool
    reaches_etcd: bool = False
    round: int = -1
    recovered_for: float | None = None  # s since its last etcd outage ended (None: never had one)


@dataclass(frozen=True)
class Verdict:
    action: Cutoff
    reason: str
    until: float | None = None  # WAIT: when the lease has surely expired (monotonic)


NO_ANSWER = "did not answer"


def judge(*, my_round: int, last_refresh_sent: float, now: float, ttl: float,
          max_rtt: float, reports: Sequence[PeerReport]) -> Verdict:
    """The rule of the module docstring. ``last_refresh_sent``: when this node sent the
    last lease refresh that etcd answered; ``max_rtt``: the longest such a refresh may
    have taken (the request timeout), so the lease was renewed before
    ``last_refresh_sent + max_rtt`` and expires before that plus ``ttl``."""
    answered = [r for r in reports if r.answered]
    if not answered:
        return Verdict(Cutoff.RIDE_OUT, f"no peer answers ({len(reports)} asked): etcd may "
                                        "be down for everyone")
    ahead = [r for r in answered if r.round > my_round]
    if ahead:
        return Verdict(Cutoff.STOP, f"peer {ahead[0].node} runs round {ahead[0].round}, "
                                    f"this node round {my_round}: the job went on without it")
    witnesses = [r.node for r in answered if r.reaches_etcd]
    if not witnesses:
        return Verdict(Cutoff.RIDE_OUT, f"{len(answered)} peer(s) answer and none reaches "
                                        "etcd: an outage for everyone")
    expired_by = last_refresh_sent + max_rtt + ttl
    # etcd was back for everyone at the latest when the first witness reconnected: a
    # lease of an outage for everyone counts from then (etcd renews every lease when it
    # elects a leader), so a node that reconnects a moment after its peers is not stopped
    ended = [r.recovered_for for r in answered if r.reaches_etcd and r.recovered_for is not None]
    if ended:
        expired_by = max(expired_by, now - max(ended) + max_rtt + ttl)
    said = f"peer(s) {', '.join(witnesses)} reach etcd and this node does not"
    if now < expired_by:
        return Verdict(Cutoff.WAIT, f"{said}; its lease expires within "
                                    f"{expired_by - now:.1f}s", until=expired_by)
    return Verdict(Cutoff.STOP, f"{said}: cut off from etcd, its lease has expired and the "
                                "others re-form without it")


def standing_since(last_refresh_sent: float, last_outage_ended: float | None) -> float:
    """Since when the others count this node as a member without hearing from it: its last
    answered lease refresh, or the end of the last outage if later (after an outage for
    everyone the leader gives every member one TTL to put its keys back)."""
    if last_outage_ended is None:
        return last_refresh_sent
    return max(last_refresh_sent, last_outage_ended)


def parse_peer_status(node: str, doc: object, run_id: str) -> PeerReport:
    """A peer's ``/status`` document as a report; anything malformed, or of another job,
    is a peer that did not answer."""
    if not isinstance(doc, Mapping) or doc.get("run_id") != run_id:
        return PeerReport(node, answered=False)
    rdzv = doc.get("rendezvous")
    if not isinstance(rdzv, Mapping):
        return PeerReport(node, answered=False)
    etcd: Any = rdzv.get("etcd")
    round_ = rdzv.get("round")
    if not isinstance(etcd, Mapping) or type(round_) is not int or round_ < 0:
        return PeerReport(node, answered=False)
    reachable = etcd.get("reachable")
    if type(reachable) is not bool:
        return PeerReport(node, answered=False)
    return PeerReport(node, answered=True, reaches_etcd=reachable, round=round_,
                      recovered_for=_seconds(etcd.get("recovered_for")))


def _seconds(value: object) -> float | None:
    """A finite, non-negative number of seconds; None for anything else (absent from
    older peers, or not to be trusted)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if 0 <= value < float("inf") else None


def peers_to_ask(members: Sequence[str], me: str, count: int) -> list[str]:
    """Up to ``count`` other members, the ones after this node in group-rank order first
    (wrapping), so that the probes of a large job spread over its nodes."""
    if me not in members:
        return [m for m in members if m != me][:count]
    i = list(members).index(me)
    ordered = list(members[i + 1:]) + list(members[:i])
    return ordered[:count]
