"""Healing at the edge: node checks, root causes and quarantine carried out for the controller.

The rules are pure (``core.nodehealth``); the facts live where the backend keeps them (a
``NodeLedger``: job-wide in etcd, in memory for the static backend). The controller asks:

- ``admit()`` before every rendezvous round: a node whose quarantine is still recorded
  waits until an operator clears it; a node whose check fails does not join, it re-checks
  every ``node_check_retry`` seconds (a pass younger than the interval is reused, except
  after a failure whose root cause was on this node);
- ``resolve(failure, round)`` while a failed group stops: the round's root cause is
  claimed job-wide; a later failure on another node is a remote consequence
  (``RemoteFailure``: no budget, no count), a local one is counted and may quarantine
  the node (``NodeQuarantined``);
- ``watch()`` while the workers run: the check every ``node_check_interval`` seconds; a
  failure quarantines at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import anyio

from supervisor.config import (
    ConfigError,
    Settings,
    healing_enabled,
    healing_limits,
    node_check_argv,
)
from supervisor.core import nodehealth as nh
from supervisor.core import state as sm
from supervisor.events import EventLog
from supervisor.rendezvous.base import NodeLedger, Rendezvous, RendezvousError
from supervisor.workers.nodecheck import CheckLauncher, NodeCheckConfigError, NodeChecker

logger = logging.getLogger(__name__)

LEDGER_TIMEOUT = 10.0  # s: a ledger that does not answer: the failure counts as today
LOCAL_KINDS = (sm.FailureKind.EXITED, sm.FailureKind.SIGNALED, sm.FailureKind.DEADLINE)


class Healing:
    """One node's healing: its checks, its failures, its quarantine."""

    def __init__(self, limits: nh.Limits, ledger: NodeLedger, checker: NodeChecker | None,
                 events: EventLog, *, interval: float, retry: float,
                 changed: Callable[[], None] = lambda: None) -> None:
        self.limits = limits
        self.ledger = ledger
        self.checker = checker
        self.events = events
        self.interval = interval
        self.retry = retry
        self.changed = changed  # republish the snapshot
        self.state = "starting"  # checking, healthy, unhealthy, held, quarantined
        self.reason = ""
        self.last_check: nh.CheckResult | None = None
        self.quarantines = 0
        self.spare_admissions = 0
        self.remote_failures = 0
        self._recheck = True  # the next admit() runs the check whatever its age
        self._job: dict[str, Any] = {}

    @property
    def enabled(self) -> bool:
        return self.limits.enabled or self.checker is not None

    # ------------------------------------------------------------------ before a round
    async def admit(self) -> sm.NodeQuarantined | None:
        """Return once this node may join a round; or the quarantine, when its check fails
        and no other node could take its place (the static backend)."""
        await self._wait_until_cleared()
        if self.checker is None:
            self._set("healthy", "")
            return None
        if not self._recheck and nh.check_is_fresh(self.last_check, time.monotonic(),
                                                   self.interval):
            return None
        while True:
            result = await self._check("before joining")
            if result.ok:
                self._recheck = False
                await self.refresh_job_view()
                return None
            if not self.ledger.replaceable:
                return self._quarantined(result.reason)
            logger.warning("node check failed, not joining; again in %g s: %s",
                           self.retry, result.reason)
            await anyio.sleep(self.retry)

    async def _wait_until_cleared(self) -> None:
        if not self.limits.enabled and self.checker is None:
            return
        try:
            with anyio.fail_after(LEDGER_TIMEOUT):
                held = await self.ledger.held()
        except (RendezvousError, TimeoutError) as exc:
            logger.warning("cannot read this node's health record: %s", exc)
            return
        if held is None:
            return
        logger.error("node %s is quarantined (%s); it stays out until its record is cleared "
                     "(elastic-supervisor node clear ... %s)", self.ledger.node, held.reason,
                     self.ledger.node)
        self.events.emit("node_held", node=self.ledger.node, reason=held.reason)
        self._set("held", held.reason)
        await self.ledger.wait_cleared()
        logger.info("node %s: quarantine cleared, joining", self.ledger.node)
        self.events.emit("node_cleared", node=self.ledger.node)
        self._recheck = True
        self._set("starting", "")

    async def _check(self, when: str) -> nh.CheckResult:
        assert self.checker is not None
        self._set("checking", self.reason)
        try:
            result = await self.checker.run()
        except NodeCheckConfigError as exc:  # exit 126/127: exit 2 with one line
            raise ConfigError(str(exc)) from None
        self.last_check = result
        self.events.emit("node_check", ok=result.ok, reason=result.reason or None, when=when,
                         seconds=round(result.duration, 6), exit_code=result.exit_code,
                         timed_out=result.timed_out or None)
        self._set("healthy" if result.ok else "unhealthy", result.reason)
        return result

    def spare_admitted(self, round: int) -> None:
        """This node waited as a spare and a round took it in."""
        self.spare_admissions += 1
        self.events.emit("spare_admitted", node=self.ledger.node, round=round)
        logger.info("admitted as a spare in round %d", round)

    # ------------------------------------------------------------------ after a failure
    async def resolve(self, failure: sm.Failure, round: int, rank: int | None
                      ) -> sm.Event | None:
        """The event that says what this failure means, or None: an ordinary failure."""
        if failure.kind not in LOCAL_KINDS:
            return None
        signature = nh.Signature(failure.kind.value, failure.local_rank, failure.exit_code,
                                 failure.signal)
        text = nh.record_text(failure.describe())
        mine = nh.RoundCause(self.ledger.node, round, signature, time.time(),
                             member=self.ledger.member,
                             rank=rank, description=text)
        try:
            with anyio.fail_after(LEDGER_TIMEOUT):
                winner = await self.ledger.claim_root_cause(mine)
                if nh.is_remote(winner, self.ledger.node):
                    return self._remote(winner)
                self._recheck = True  # the root cause was here: check before rejoining
                if not self.limits.enabled:
                    return None
                judgement = await self.ledger.record_failure(
                    nh.NodeFailure(mine.at, round, signature, text))
        except (RendezvousError, TimeoutError) as exc:
            logger.warning("cannot record this failure job-wide (it counts as this node's): "
                           "%s", exc)
            return None
        await self.refresh_job_view()
        self.events.emit("node_failure", verdict=judgement.verdict.value,
                         reason=judgement.reason, failures=len(judgement.failures))
        if judgement.quarantine:
            return self._quarantined(judgement.reason)
        if judgement.verdict is not nh.Verdict.COUNT:
            logger.warning("not quarantining this node: %s", judgement.reason)
        return None

    def _remote(self, winner: nh.RoundCause) -> sm.RemoteFailure:
        self.remote_failures += 1
        message = (f"a consequence of node {winner.node}'s failure in round {winner.round} "
                   f"({winner.description or winner.signature.describe()})")
        logger.info("this node's failure is %s: no restart used", message)
        self.events.emit("remote_failure", node=winner.node, round=winner.round,
                         cause=winner.description or None)
        return sm.RemoteFailure(message, time.monotonic())

    def _quarantined(self, reason: str) -> sm.NodeQuarantined:
        self.quarantines += 1
        logger.error("quarantining node %s: %s", self.ledger.node, reason)
        self.events.emit("node_quarantined", node=self.ledger.node, reason=reason)
        self._set("quarantined", reason)
        return sm.NodeQuarantined(reason, time.monotonic())

    # ------------------------------------------------------------------ while running
    async def watch(self) -> sm.NodeQuarantined:
        """Check every interval while the workers run; return the quarantine once a check
        fails (never returns with no interval)."""
        if self.checker is None or self.interval <= 0:
            await anyio.sleep_forever()
        while True:
            last = self.last_check.at if self.last_check else time.monotonic()
            await anyio.sleep(max(0.0, last + self.interval - time.monotonic()))
            result = await self._check("while running")
            if killed_from_outside(result):  # not evidence about the node: check again
                logger.warning("node check was killed by a signal it was not sent by us "
                               "(%s); checking again", result.reason)
                result = await self._check("while running, again")
            if not result.ok:
                try:
                    with anyio.fail_after(LEDGER_TIMEOUT):
                        await self.ledger.quarantine(result.reason)
                except (RendezvousError, TimeoutError) as exc:
                    logger.warning("cannot record the quarantine job-wide: %s", exc)
                return self._quarantined(result.reason)

    # ------------------------------------------------------------------ views
    def _set(self, state: str, reason: str) -> None:
        if (state, reason) != (self.state, self.reason):
            self.state, self.reason = state, reason
            self.changed()

    async def refresh_job_view(self) -> None:
        """Read every node's record once (for /status); best effort."""
        try:
            with anyio.fail_after(LEDGER_TIMEOUT):
                self._job = await self.ledger.job_view()
        except (RendezvousError, TimeoutError) as exc:
            logger.debug("cannot read the job's node records: %s", exc)

    def view(self) -> dict[str, Any]:
        """This node's health for /status."""
        check = self.last_check
        return {
            "node": self.ledger.node,
            "state": "spare" if self.ledger.spare and self.state == "healthy" else self.state,
            "spare": self.ledger.spare,
            "reason": self.reason or None,
            "last_check": None if check is None else {
                "ok": check.ok, "reason": check.reason or None,
                "seconds": round(check.duration, 6), "age": round(time.monotonic() - check.at, 3),
            },
            "limits": {"max_node_failures": self.limits.max_node_failures,
                       "window": self.limits.window,
                       "max_quarantined": self.limits.max_quarantined},
            "counts": {"quarantines": self.quarantines, "spare_admissions":
                       self.spare_admissions, "remote_failures": self.remote_failures,
                       "checks": self.checker.runs if self.checker else 0,
                       "check_failures": self.checker.failures if self.checker else 0},
            "job": self._job or None,
        }

    def status_line(self) -> str | None:
        """STATUS= while this node is not in a round for a health reason (or is a spare)."""
        if self.state == "held":
            return f"quarantined: waiting until its record is cleared ({self.reason})"
        if self.state == "unhealthy":
            return f"node check failing, not joining: {self.reason}"
        if self.ledger.spare:
            return "spare: waiting to be admitted"
        return None


def killed_from_outside(result: nh.CheckResult) -> bool:
    """The check died by a signal that was not its timeout's SIGKILL (a stop's sweep, an
    operator): inconclusive."""
    return not result.ok and not result.timed_out and (result.exit_code or 0) < 0


def make_healing(settings: Settings, rendezvous: Rendezvous, events: EventLog,
                 base_env: Mapping[str, str], run_id: str, log_root: Path, *,
                 launcher: CheckLauncher, changed: Callable[[], None]) -> Healing:
    """Root causes always; node checks and quarantine when asked for (``healing_enabled``).
    The check gets the rank-independent part of the workers' environment (with the
    guardian's cookie) and is started as they are (``launcher``)."""
    limits = healing_limits(settings)
    ledger = rendezvous.node_ledger(limits)
    checker = None
    if healing_enabled(settings):
        env = {**base_env, "TORCHELASTIC_RUN_ID": run_id, "ELASTIC_SUPERVISOR_RUN_ID": run_id,
               "ELASTIC_SUPERVISOR_NODE_ID": ledger.node, "ROLE_NAME": settings.role,
               "LOCAL_WORLD_SIZE": str(settings.local_world_size),
               "TORCHELASTIC_MAX_RESTARTS": str(settings.max_restarts)}
        checker = NodeChecker(node_check_argv(settings), env, settings.node_check_timeout,
                              log_root, launcher)
    return Healing(limits, ledger, checker, events, interval=settings.node_check_interval,
                   retry=settings.node_check_retry, changed=changed)
