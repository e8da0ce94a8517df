"""Restart policy: budget, healing window, retryable exit codes and backoff.

Pure code: the caller passes the clock reading and a uniform random draw, so a test can
replay any sequence of failures and healthy periods and check every decision.
"""

from __future__ import annotations

import msgspec
from msgspec.structs import replace


class RestartHistory(msgspec.Struct, frozen=True):
    """Failure restarts that still count against the budget, and when the group last started."""

    restarts: tuple[float, ...] = ()
    group_started_at: float | None = None
    peer_losses: tuple[float, ...] = ()  # budget-free restarts for lost peers (core.peers)

    def started(self, now: float) -> RestartHistory:
        return replace(self, group_started_at=now)


# Budget-free restarts for lost peers: at most LIMIT in any WINDOW seconds on a node; past
# that a lost peer's failure counts as any other, so a job whose peers keep vanishing ends.
PEER_LOSS_LIMIT = 3
PEER_LOSS_WINDOW = 600.0


class Verdict(msgspec.Struct, frozen=True):
    restart: bool
    delay: float
    reason: str  # why, for the failure summary, event log and metrics
    budget_left: int
    history: RestartHistory
    ceiling: float = 0.0  # the backoff's bound before jitter


class RestartPolicy(msgspec.Struct, frozen=True):
    """What to do after a failure. Defaults match torchrun: no backoff, no healing."""

    max_restarts: int = 0
    backoff_base: float = 0.0
    backoff_max: float = 0.0
    budget_window: float | None = None
    no_restart_exit_codes: frozenset[int] = msgspec.field(default_factory=frozenset)
    restart_exit_codes: frozenset[int] | None = None  # allow-list; None allows all
    peer_loss_limit: int = PEER_LOSS_LIMIT
    peer_loss_window: float = PEER_LOSS_WINDOW

    def healed(self, history: RestartHistory, now: float) -> RestartHistory:
        """Forget restarts once the group has run healthy for the whole window."""
        started = history.group_started_at
        if self.budget_window is None or started is None:
            return history
        if now - started >= self.budget_window:
            return replace(history, restarts=())
        return history

    def ceiling(self, used: int) -> float:
        """The largest backoff after ``used`` counted restarts: min(max, base * 2**used)."""
        if self.backoff_base <= 0:
            return 0.0
        return min(self.backoff_max, self.backoff_base * (2.0 ** min(used, 62)))

    def backoff(self, used: int, jitter: float) -> float:
        """Exponential backoff with full jitter: uniform in [0, ceiling(used)]."""
        return max(0.0, min(1.0, jitter)) * self.ceiling(used)

    def decide(
        self,
        history: RestartHistory,
        exit_code: int | None,
        now: float,
        jitter: float,
        job_restarts: int = 0,
    ) -> Verdict:
        """Restart or give up after a failure whose root cause exited with ``exit_code``.

        ``job_restarts`` is the job-wide count (every node's failure restarts): without a
        healing window the budget is the job's, so ``--max-restarts`` means the same on
        every node; with a window each node heals its own count.
        """
        history = self.healed(history, now)
        used = len(history.restarts)
        if self.budget_window is None:
            used = max(used, job_restarts)
        left = max(0, self.max_restarts - used)
        if exit_code is not None and exit_code in self.no_restart_exit_codes:
            return Verdict(False, 0.0, f"exit code {exit_code} is not retryable", left, history)
        if (
            self.restart_exit_codes is not None
            and exit_code is not None
            and exit_code not in self.restart_exit_codes
        ):
            reason = f"exit code {exit_code} is not in the restart allow-list"
            return Verdict(False, 0.0, reason, left, history)
        if left <= 0:
            reason = f"restart budget exhausted ({used}/{self.max_restarts} used)"
            return Verdict(False, 0.0, reason, 0, history)
        delay = self.backoff(used, jitter)
        history = replace(history, restarts=(*history.restarts, now))
        reason = f"restart {used + 1}/{self.max_restarts} after {delay:.3f} s"
        return Verdict(True, delay, reason, left - 1, history, self.ceiling(used))

    def budget_left(self, history: RestartHistory, now: float) -> int:
        return max(0, self.max_restarts - len(self.healed(history, now).restarts))

    def peer_loss_free(self, history: RestartHistory, now: float) -> bool:
        """Whether a failure that came from a lost peer may restart without the budget:
        fewer than ``peer_loss_limit`` such restarts in the last ``peer_loss_window``."""
        return len(self._recent_peer_losses(history, now)) < self.peer_loss_limit

    def spend_peer_loss(self, history: RestartHistory, now: float) -> RestartHistory:
        """``history`` with one more budget-free restart for a lost peer at ``now``."""
        return replace(history, peer_losses=(*self._recent_peer_losses(history, now), now))

    def _recent_peer_losses(self, history: RestartHistory, now: float) -> tuple[float, ...]:
        return tuple(t for t in history.peer_losses if now - t < self.peer_loss_window)
