"""The static backend's node health facts: this node only, in memory.

With nothing to replace a node by, a quarantine ends the run with the quarantine exit
code; a supervisor started again has forgotten it (there is no job-wide record)."""

from __future__ import annotations

import socket
import time
from typing import Any

import anyio

from supervisor.core import nodehealth as nh


class LocalNodeLedger:
    """A ``NodeLedger`` whose every failure is this node's (one node, or nodes that do not
    coordinate: the static backend)."""

    def __init__(self, limits: nh.Limits, node: str | None = None) -> None:
        self.node = node or socket.gethostname()
        self.member = self.node
        self.replaceable = False
        self.limits = limits
        self._record = nh.NodeRecord(self.node)

    @property
    def spare(self) -> bool:
        return False

    async def claim_root_cause(self, cause: nh.RoundCause) -> nh.RoundCause:
        return cause

    async def record_failure(self, failure: nh.NodeFailure) -> nh.Judgement:
        now = time.time()
        self._record = nh.with_failure(self._record, failure, now, self.limits.window)
        judgement = nh.judge(self._record, [], self.limits, now)
        if judgement.quarantine:
            self._record = nh.quarantined(self._record, judgement.reason, now)
        return judgement

    async def quarantine(self, reason: str) -> None:
        self._record = nh.quarantined(self._record, reason, time.time())

    async def held(self) -> nh.Quarantine | None:
        return None  # a new run starts afresh: nothing is kept across runs

    async def wait_cleared(self) -> None:
        await anyio.lowlevel.checkpoint()

    async def job_view(self) -> dict[str, Any]:
        held = self._record.quarantined
        return {"quarantined": [{"node": self.node, "reason": held.reason, "at": held.at}]
                if held else [],
                "failures": {self.node: len(nh.recent(self._record.failures, time.time(),
                                                      self.limits.window))}}
