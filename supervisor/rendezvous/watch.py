"""The membership watch of one attempt: reports ``MembershipChanged`` into the inbox.

It reports and never decides. Its lifetime is the attempt's, so it runs in the attempt's
monitor task group (``WorkerGroup.supervise``), beside the worker monitors, on purpose:

- its question, "is this attempt's round outdated?", is about ``attempt.round`` and has
  no meaning before the attempt is launched (a change during a rendezvous is the
  rendezvous's to handle) or after it is stopped (the next round answers it);
- the stop already cancels that group (``attempt.scope``) once the workers are reaped,
  so the watch ends with no bookkeeping of its own; in the controller's task group it
  would need a second per-attempt cancel scope kept in step with the first;
- a watch that outlived its attempt would hold an etcd watch open through the next
  rendezvous and could only post events that are stale drops by then.
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
