"""Saying what a rendezvous waits for while it waits: a line every 30 s and ``/status``.

A round can take minutes (the other nodes are still being scheduled) and etcd may not
answer yet (a c10d host still starting, a name that does not resolve): without a word
the supervisor looks hung. Pure logic: the clock is passed in, the caller logs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

REPORT_EVERY = 30.0  # seconds between two lines about one wait
# how aiohttp and the resolver say a name does not resolve (client's failure text)
_UNRESOLVED = ("DNSError", "Name or service not known", "name resolution",
               "nodename nor servname", "No address associated")


@dataclass(frozen=True)
class WaitProgress:
    """One wait as seen now: what for, how many nodes joined of how many needed, since."""

    what: str
    since_wall: float  # epoch seconds the wait began
    waited: float  # seconds so far
    joined: int | None = None  # None when unknown (etcd not answering, or not counted)
    needed: int = 0
    max_nodes: int = 0
    cause: str = ""  # why etcd does not answer, when that is the wait

    def line(self) -> str:
        since = time.strftime("%H:%M:%S", time.localtime(self.since_wall))
        text = f"waiting {self.waited:.0f}s (since {since}) for {self.what}"
        if self.joined is not None:
            text += (f": {self.joined} of {self.needed} node(s) joined"
                     + (f" (max {self.max_nodes})" if self.max_nodes != self.needed else ""))
        return text + (f": {self.cause}" if self.cause else "")

    def level(self) -> int:
        """WARNING when a host name does not resolve: that wait never ends by itself."""
        return logging.WARNING if unresolved(self.cause) else logging.INFO

    def as_status(self) -> dict[str, Any]:
        return {"what": self.what, "since": round(self.since_wall, 3),
                "waited": round(self.waited, 3), "joined": self.joined, "needed": self.needed,
                "max_nodes": self.max_nodes, "cause": self.cause or None}


def unresolved(cause: str) -> bool:
    """Whether a connection failure's text says a host name did not resolve."""
    return any(marker in cause for marker in _UNRESOLVED)


@dataclass
class WaitClock:
    """When a wait began and when its next line is due (monotonic seconds)."""

    started: float
    started_wall: float
    every: float = REPORT_EVERY
    next_due_now: bool = False  # the first line at once (else after ``every``)
    cause: str = ""  # what the wait's caller last blamed, if anything
    announced: bool = False  # the wait was published once (status) already
    next_due: float = field(init=False)

    def __post_init__(self) -> None:
        self.next_due = self.started + (0.0 if self.next_due_now else self.every)

    def due(self, now: float) -> bool:
        return now >= self.next_due

    def reported(self, now: float) -> None:
        while self.next_due <= now:
            self.next_due += self.every

    def waited(self, now: float) -> float:
        return max(0.0, now - self.started)
