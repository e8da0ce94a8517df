"""The membership watch of one attempt: reports ``MembershipChanged`` into the inbox.

Started beside the attempt's worker monitors and cancelled with them (its question, "is
this attempt's round outdated?", ends with the attempt); it reports and never decides.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from supervisor.core import state as sm
from supervisor.events import EventLog
from supervisor.rendezvous.base import Rendezvous, RendezvousError

if TYPE_CHECKING:
    from supervisor.workers.group import Attempt


class MembershipWatch:
    """Waits for the rendezvous to outdate an attempt's round; posts why."""

    def __init__(
        self, rendezvous: Rendezvous, events: EventLog, post: Callable[[sm.Event], None]
    ) -> None:
        self.rendezvous = rendezvous
        self.events = events
        self.post = post

    async def watch(self, attempt: Attempt) -> None:
        try:
            reason = await self.rendezvous.wait_membership_change(attempt.round)
        except RendezvousError as exc:
            reason = f"rendezvous lost: {exc}"
        self.events.emit("membership_changed", reason=reason)
        self.post(sm.MembershipChanged(reason, attempt.number))
