"""Errors shared by modules that must not import each other: the registry raises config
errors, the rendezvous' wire layer raises rendezvous errors below the protocol, and
``torchcompat`` turns the API's failure into torch's (``supervisor.api`` exports it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class ConfigError(Exception):
    """A bad setting: the message is one line naming the key and what is wrong."""


class RendezvousError(Exception):
    """The rendezvous cannot complete (timeout, closed job, unreachable service)."""


@dataclass(frozen=True)
class RankFailure:
    """One failed rank of the last attempt (torch's ``ProcessFailure``)."""

    global_rank: int
    local_rank: int
    pid: int | None
    exit_code: int | None  # None when the rank died by a signal
    signal: str | None
    message: str  # "<Type>: <text>" from the error file, else what the supervisor saw
    traceback: str
    error_file: str
    timestamp: float | None  # wall clock of the exit (or of the error file)

    def describe(self) -> str:
        how = f"exit code {self.exit_code}" if self.exit_code is not None else (
            f"signal {self.signal}" if self.signal else "failed")
        head = f"rank {self.global_rank} (local rank {self.local_rank}, pid {self.pid}): {how}"
        return f"{head}: {self.message}" if self.message else head


class WorkerGroupFailed(Exception):
    """The worker group failed for good: torch's ``ChildFailedError`` for this supervisor.

    ``rank_failures`` maps global rank to ``RankFailure`` in the order the supervisor
    observed them (the first is the root cause); it is empty when no worker failed by
    itself (a rendezvous error, a deadline the watchdog enforced: see ``root_cause``).
    ``failures`` is the same mapping, except when the exception is also torch's
    ``ChildFailedError`` (``supervisor.torchcompat``): then it holds torch's
    ``ProcessFailure`` values, as torch's own code expects.
    """

    def __init__(
        self, name: str, failures: Mapping[int, RankFailure], *, exit_code: int, root_cause: str
    ) -> None:
        self.name = name
        self.rank_failures = dict(failures)
        self.failures: Mapping[int, Any] = self.rank_failures
        self.exit_code = exit_code
        self.root_cause = root_cause
        # not super(): with ChildFailedError as a second base, its __init__ comes next
        Exception.__init__(self, self.format_msg())

    def get_first_failure(self) -> tuple[int, Any] | None:
        """The root cause's (global rank, failure), like ``ChildFailedError``'s."""
        return next(iter(self.failures.items()), None)

    @property
    def message(self) -> str:
        first = next(iter(self.rank_failures.values()), None)
        return first.message if first and first.message else self.root_cause

    @property
    def traceback(self) -> str:
        first = next(iter(self.rank_failures.values()), None)
        return first.traceback if first else ""

    def format_msg(self) -> str:
        lines = [f"{self.name} FAILED (exit code {self.exit_code})",
                 f"root cause: {self.root_cause or self.message}"]
        for index, failure in enumerate(self.rank_failures.values()):
            lines.append(("first failure: " if index == 0 else "also failed: ")
                         + failure.describe())
            lines.append(f"  error file: {failure.error_file}")
            if failure.traceback:
                lines += ["  " + ln for ln in failure.traceback.rstrip().splitlines()]
        return "\n".join(lines)
