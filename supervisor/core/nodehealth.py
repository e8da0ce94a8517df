"""Node health rules: which failures are this node's, and when a node quarantines itself.

Pure code (DESIGN section 8): the edge (``supervisor.healing``) reads and writes the facts
in etcd and passes them in with the wall-clock time; every rule here is a function of them.

- **One root cause per round, job-wide.** The first failure of a round that any node
  records (a compare-and-swap in etcd) is the round's root cause; a later failure of the
  same round on another node is a *remote consequence*: it counts neither against that
  node nor against the restart budget (``is_remote``).
- **K failures in S seconds.** A node that is the root cause of ``max_node_failures``
  failures within ``node_failure_window`` seconds quarantines itself (``judge``), unless
- **the failure follows the rank, not the host**: the same failure (same local rank, same
  kind and exit code or signal) was also the root cause on another node within the
  window: a bug in the script moves with the rank when the job moves to other nodes, and
  no node is to blame; or
- **the job-wide cap** (``max_quarantined``, default 1) is reached: a bug that looks like
  a node's can never quarantine the healthy nodes one by one.

Times are wall-clock seconds (``time.time()``): records are shared by nodes through etcd,
and a window of an hour is far above any clock skew worth caring about.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence

import msgspec

EXIT_QUARANTINED = 200
"""The supervisor's exit code when its node quarantined itself (above 128+SIGRTMAX)."""

DEFAULT_WINDOW = 3600.0
DEFAULT_MAX_QUARANTINED = 1
MAX_KEPT_FAILURES = 64  # per node record: bounds its size whatever K is
MAX_TEXT = 300  # characters of a description kept in a record


class Signature(msgspec.Struct, frozen=True):
    """What makes two failures "the same" for the rank-following rule."""

    kind: str  # exited, signaled, deadline, node_check, ...
    local_rank: int | None = None
    exit_code: int | None = None
    signal: int | None = None

    def describe(self) -> str:
        where = "node" if self.local_rank is None else f"local rank {self.local_rank}"
        if self.exit_code is not None:
            return f"{where} exited with code {self.exit_code}"
        if self.signal is not None:
            return f"{where} killed by signal {self.signal}"
        return f"{where} {self.kind}"


class RoundCause(msgspec.Struct, frozen=True):
    """The root cause of one round, as the first node to record it wrote it."""

    node: str  # health id of the node (node_id, else the host name)
    round: int
    signature: Signature
    at: float  # wall clock
    member: str = ""  # the rendezvous member id of that node
    rank: int | None = None  # global rank
    description: str = ""


class NodeFailure(msgspec.Struct, frozen=True):
    """One failure whose root cause was on a node."""

    at: float  # wall clock
    round: int
    signature: Signature
    description: str = ""


class Quarantine(msgspec.Struct, frozen=True):
    at: float
    reason: str


class NodeRecord(msgspec.Struct, frozen=True):
    """A node's failures in the window and its quarantine, as kept job-wide."""

    node: str
    member: str = ""  # its latest rendezvous member id (for the leader's round reasons)
    failures: tuple[NodeFailure, ...] = ()
    quarantined: Quarantine | None = None


class Limits(msgspec.Struct, frozen=True):
    """``--max-node-failures K`` (0: off), ``--node-failure-window S``, ``--max-quarantined``."""

    max_node_failures: int = 0
    window: float = DEFAULT_WINDOW
    max_quarantined: int = DEFAULT_MAX_QUARANTINED

    @property
    def enabled(self) -> bool:
        return self.max_node_failures > 0


class Verdict(enum.Enum):
    """What a local root-cause failure means for this node."""

    COUNT = "count"  # below K: an ordinary failure (the restart budget decides)
    QUARANTINE = "quarantine"  # K in the window: leave, exit EXIT_QUARANTINED
    FOLLOWS_RANK = "follows_rank"  # K reached, but the job's bug, not the node's
    CAPPED = "capped"  # K reached, but the job-wide cap of quarantines is reached


class Judgement(msgspec.Struct, frozen=True):
    verdict: Verdict
    reason: str
    failures: tuple[NodeFailure, ...] = ()  # this node's failures in the window

    @property
    def quarantine(self) -> bool:
        return self.verdict is Verdict.QUARANTINE


def is_remote(winner: RoundCause, me: str) -> bool:
    """Whether this node's failure is a consequence of another node's (``winner`` is the
    round's recorded root cause)."""
    return winner.node != me


def recent(failures: Iterable[NodeFailure], now: float, window: float) -> tuple[NodeFailure, ...]:
    """The failures within the window ending at ``now`` (oldest first)."""
    return tuple(sorted((f for f in failures if now - f.at < window), key=lambda f: f.at))


def with_failure(record: NodeRecord, failure: NodeFailure, now: float, window: float,
                 member: str = "") -> NodeRecord:
    """The record with ``failure`` added and failures older than the window dropped."""
    kept = recent((*record.failures, failure), now, window)[-MAX_KEPT_FAILURES:]
    return msgspec.structs.replace(record, failures=kept, member=member or record.member)


def quarantined(record: NodeRecord, reason: str, now: float) -> NodeRecord:
    return msgspec.structs.replace(record, quarantined=Quarantine(now, record_text(reason)))


def record_text(text: str) -> str:
    """A description or reason as records keep it: one printable line of at most
    ``MAX_TEXT`` characters (the rule every node's reader holds records to)."""
    return "".join(c if c.isprintable() else " " for c in text[:MAX_TEXT])


def judge(mine: NodeRecord, others: Sequence[NodeRecord], limits: Limits,
          now: float) -> Judgement:
    """Decide on this node's latest root-cause failure (the last of ``mine.failures``).
    ``others``: every other node's record in the job (quarantined or not)."""
    failures = recent(mine.failures, now, limits.window)
    if not limits.enabled or not failures:
        return Judgement(Verdict.COUNT, "node failure limits are off", failures)
    k = limits.max_node_failures
    if len(failures) < k:
        return Judgement(Verdict.COUNT, f"{len(failures)}/{k} failures of this node within "
                                        f"{limits.window:g} s", failures)
    latest = failures[-1]
    for other in others:
        if other.node == mine.node:
            continue
        same = [f for f in recent(other.failures, now, limits.window)
                if f.signature == latest.signature]
        if same:
            reason = (f"{k} failures within {limits.window:g} s, but the same failure "
                      f"({latest.signature.describe()}) was also the root cause on node "
                      f"{other.node}: it follows the rank, not the host (a bug of the job)")
            return Judgement(Verdict.FOLLOWS_RANK, reason, failures)
    held = sorted(o.node for o in others if o.quarantined is not None and o.node != mine.node)
    if len(held) >= limits.max_quarantined:
        reason = (f"{k} failures within {limits.window:g} s, but {len(held)} node(s) are "
                  f"quarantined already ({', '.join(held)}; max_quarantined "
                  f"{limits.max_quarantined}): not quarantining another")
        return Judgement(Verdict.CAPPED, reason, failures)
    return Judgement(Verdict.QUARANTINE, quarantine_reason(failures, limits), failures)


def quarantine_reason(failures: Sequence[NodeFailure], limits: Limits) -> str:
    """One line naming the failures that quarantine the node."""
    named = "; ".join(f"round {f.round}: {f.description or f.signature.describe()}"
                      for f in failures[-limits.max_node_failures:])
    return (f"{len(failures)} failure(s) of this node within {limits.window:g} s "
            f"(max_node_failures {limits.max_node_failures}): {named}")[:MAX_TEXT * 2]


def start_warnings(limits: Limits, max_restarts: int) -> list[str]:
    """Lines to log at start for limits that cannot work as set."""
    notes = []
    k = limits.max_node_failures
    if k > 0 and k - 1 > max_restarts:
        notes.append(f"max_node_failures: {k} failures can never be reached with "
                     f"--max-restarts {max_restarts} (the {k - 1} failures before the "
                     f"quarantine each use a restart): no node will be quarantined")
    return notes


def check_limits(limits: Limits) -> list[str]:
    """Problems with the settings (each one line naming the setting)."""
    problems = []
    if limits.max_node_failures < 0:
        problems.append(f"max_node_failures: must be >= 0, got {limits.max_node_failures}")
    if not 0 < limits.window < math.inf:
        problems.append(f"node_failure_window: must be a positive number of seconds, "
                        f"got {limits.window}")
    if limits.max_quarantined < 0:
        problems.append(f"max_quarantined: must be >= 0, got {limits.max_quarantined}")
    return problems


# ----------------------------------------------------------------- node checks


class CheckResult(msgspec.Struct, frozen=True):
    """One run of the node check (the command and the built-in checks)."""

    ok: bool
    reason: str  # "" when ok
    at: float  # monotonic, when it finished
    duration: float = 0.0
    exit_code: int | None = None
    timed_out: bool = False


def check_is_fresh(last: CheckResult | None, now: float, interval: float) -> bool:
    """A membership restart reuses a passing check younger than the interval (a check such
    as ``dcgmi diag`` takes tens of seconds: not on every restart path). Interval 0 (no
    checks while running): a pass is reused until a local failure asks for a new one."""
    if last is None or not last.ok:
        return False
    return interval <= 0 or now - last.at < interval


def first_line(output: bytes) -> str:
    """The first non-empty line of a check's output, printable and bounded."""
    for raw in output.splitlines():
        line = raw.decode(errors="replace").strip()
        if line:
            return "".join(c if c.isprintable() else "?" for c in line)[:MAX_TEXT]
    return ""


def check_failure_reason(exit_code: int | None, timed_out: bool, timeout: float,
                         output: bytes) -> str:
    line = first_line(output)
    if timed_out:
        what = f"timed out after {timeout:g} s"
    elif exit_code is not None and exit_code < 0:
        what = f"killed by signal {-exit_code}"
    else:
        what = f"exited with code {exit_code}"
    return f"node check {what}" + (f": {line}" if line else "")


MIN_FREE_BYTES = 256 * 1024 * 1024
"""The built-in check's free-space floor on the log directory's file system."""


def disk_verdict(free_bytes: int, writable: bool, path: str) -> str:
    """"" when the log directory is usable, else the reason."""
    if not writable:
        return f"log directory {path} is not writable"
    if free_bytes < MIN_FREE_BYTES:
        return (f"log directory {path} has {free_bytes // (1024 * 1024)} MiB free "
                f"(the built-in node check needs {MIN_FREE_BYTES // (1024 * 1024)} MiB)")
    return ""
