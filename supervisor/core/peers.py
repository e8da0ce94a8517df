"""Which peers of a round are gone? The rule, as pure logic (no I/O, no clock).

When a local rank fails, the cause may be a peer node that vanished (its collective broke
before etcd noticed the loss: a lease lives for its TTL). The edge asks the round's other
members (``Rendezvous.check_peers``): each one's health endpoint (``/status``), and, where
the backend has leases, whether the member's lease still holds its key. :func:`judge`
turns what was seen into a :class:`PeerCheck`:

- **gone**: its health endpoint refused the connection (the host is up, nothing listens
  there: its supervisor died), or its lease is gone (etcd dropped its keys);
- **alive**: it answered with a status document of the same job and its lease holds;
- **unsure**: anything else (a timeout, an error, a malformed answer, no URL known). A slow
  or ambiguous answer never makes a loss: the failure is then accounted as today.

The verdict is a fact about peers; what it means for the restart budget (a membership
change, within a cap: ``RestartPolicy.peer_loss_free``) is the state machine's
(``core.state.PeerLost``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import msgspec

CHECK_BOUND = 1.0  # s: the whole check, every peer at once; later answers are "unsure"


class Seen(enum.Enum):
    """What one peer's health endpoint did."""

    ANSWERED = "answered"  # a status document of this job
    REFUSED = "refused"  # connection refused: nothing listens, the host is up
    NO_ANSWER = "no_answer"  # a timeout, another error or a malformed answer
    NO_URL = "no_url"  # this node does not know where to ask


class PeerAnswer(msgspec.Struct, frozen=True):
    """One peer's health endpoint, as asked (``url`` for the log)."""

    node: str
    seen: Seen
    url: str = ""


class LostPeer(msgspec.Struct, frozen=True):
    """A peer confirmed gone, and how it was seen."""

    node: str
    how: str

    def describe(self) -> str:
        return f"node {self.node} ({self.how})"


class PeerCheck(msgspec.Struct, frozen=True):
    """The round's other members, sorted by what was seen."""

    lost: tuple[LostPeer, ...] = ()
    alive: tuple[str, ...] = ()
    unsure: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line: the lost peers, and how each was seen."""
        return "; ".join(p.describe() for p in self.lost) or "no peer confirmed gone"


def judge(answers: Sequence[PeerAnswer], leases: Mapping[str, bool] | None) -> PeerCheck:
    """The rule of the module docstring. ``leases``: member -> whether its lease still holds
    its key (None: the backend could not tell, or has no leases)."""
    lost: list[LostPeer] = []
    alive: list[str] = []
    unsure: list[str] = []
    for answer in answers:
        held = None if leases is None else leases.get(answer.node)
        if answer.seen is Seen.REFUSED:
            where = f" at {answer.url}" if answer.url else ""
            lost.append(LostPeer(answer.node, f"its health endpoint{where} refused the "
                                              "connection"))
        elif held is False:
            lost.append(LostPeer(answer.node, "its lease is gone"))
        elif answer.seen is Seen.ANSWERED:
            alive.append(answer.node)
        else:
            unsure.append(answer.node)
    return PeerCheck(tuple(lost), tuple(alive), tuple(unsure))
