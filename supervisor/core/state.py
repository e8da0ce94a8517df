"""The supervisor's run loop as an explicit, pure state machine.

``transition(state, event, policy)`` is the only place that decides what happens next.
It returns the new state and one decision; the controller carries the decision out.
Nothing here does I/O, reads a clock or touches a process: times and random draws
arrive inside the events, so every edge is reproducible in a unit test.
"""

from __future__ import annotations

import enum
import signal

import msgspec
from msgspec.structs import replace

from supervisor.core.nodehealth import EXIT_QUARANTINED
from supervisor.core.peers import LostPeer
from supervisor.core.policy import RestartHistory, RestartPolicy

# An attempt the supervisor cannot prepare (full log disk, no inodes) is retried after
# 1, 2, 4, ... 30 s, at most PREPARE_RETRIES times in a row (about 3.5 min in all), then the
# job ends with EXIT_PREPARE_FAILED (sysexits' EX_CANTCREAT); never the restart budget.
PREPARE_RETRIES = 10
PREPARE_RETRY_MAX = 30.0
EXIT_PREPARE_FAILED = 73


class Phase(enum.Enum):
    """Where the supervisor is in its run loop."""

    RENDEZVOUS = "rendezvous"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    BACKOFF = "backoff"
    EXIT_BARRIER = "exit_barrier"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    QUARANTINED = "quarantined"  # this node took itself out of the job (core.nodehealth)

    @property
    def final(self) -> bool:
        return self in (Phase.SUCCEEDED, Phase.FAILED, Phase.STOPPED, Phase.QUARANTINED)


class StopReason(enum.Enum):
    """Why a group is being stopped; decides where STOPPING leads."""

    FAILURE = "failure"  # a worker failed or hung: restart within the policy
    MEMBERSHIP = "membership"  # nodes joined or left: next round, no budget used
    SHUTDOWN = "shutdown"  # a signal asked us to stop: exit 128+N
    FATAL = "fatal"  # the node is unhealthy (D state): stop, never restart
    BARRIER = "barrier"  # another node failed while we waited at the exit barrier
    QUARANTINE = "quarantine"  # this node is bad: stop, leave gracefully, never restart


class FailureKind(enum.Enum):
    EXITED = "exited"  # non-zero exit code
    SIGNALED = "signaled"  # died by a signal
    DEADLINE = "deadline"  # a watchdog deadline expired
    UNHEALTHY = "unhealthy"  # uninterruptible sleep or similar
    REMOTE = "remote"  # another node's failure (multi-node)
    RENDEZVOUS = "rendezvous"  # rendezvous could not complete
    SUPERVISOR = "supervisor"  # the supervisor could not prepare an attempt (disk full...)
    NODE_CHECK = "node_check"  # the node check failed while the workers ran
    NODE_LOST = "node_lost"  # a peer node of the round was confirmed gone (core.peers)


class Failure(msgspec.Struct, frozen=True):
    """One observed failure; the first one of an attempt is its root cause."""

    kind: FailureKind
    attempt: int
    at: float  # monotonic seconds when the supervisor observed it
    local_rank: int | None = None
    pid: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    message: str = ""

    def describe(self) -> str:
        """A one-line human description used in summaries and STATUS lines."""
        where = f"local rank {self.local_rank}" if self.local_rank is not None else "node"
        if self.kind is FailureKind.NODE_LOST:
            where, what = "peer", "lost"
        elif self.kind is FailureKind.SIGNALED and self.signal is not None:
            what = f"killed by {signal_name(self.signal)}"
        elif self.kind is FailureKind.EXITED:
            what = f"exited with code {self.exit_code}"
        else:
            what = self.kind.value
        text = f"{where} (pid {self.pid}) {what}" if self.pid else f"{where} {what}"
        return f"{text}: {bounded(self.message)}" if self.message else text

    @property
    def process_exit_code(self) -> int:
        """The code the supervisor exits with when this failure ends the job."""
        if self.kind is FailureKind.SUPERVISOR:
            return EXIT_PREPARE_FAILED
        if self.exit_code is not None and 1 <= self.exit_code <= 125:
            return self.exit_code
        return 1


MAX_MESSAGE = 240  # characters of a failure's message in one line (the error file has all)


def bounded(message: str) -> str:
    """One line of at most MAX_MESSAGE characters: a worker's error (a gloo error is
    ~300) is repeated by several lines, each must stay readable."""
    line = " ".join(message.split())
    return line if len(line) <= MAX_MESSAGE else line[:MAX_MESSAGE - 3] + "..."


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# ----------------------------------------------------------------------------- events


class RendezvousComplete(msgspec.Struct, frozen=True):
    round: int
    world_size: int
    restart_count: int = 0  # job-wide failure restarts so far (all nodes)


class RendezvousFailed(msgspec.Struct, frozen=True):
    message: str
    at: float
    job_succeeded: bool = False  # the job ended well without this node (a spare)


class LaunchFailed(msgspec.Struct, frozen=True):
    """The supervisor could not prepare the attempt (nothing was started)."""

    attempt: int
    message: str
    at: float


class GroupLaunched(msgspec.Struct, frozen=True):
    attempt: int
    local_ranks: frozenset[int]
    at: float


class WorkerExited(msgspec.Struct, frozen=True):
    attempt: int
    local_rank: int
    pid: int
    exit_code: int | None  # None when killed by a signal
    signal: int | None
    at: float
    message: str = ""  # from the worker's error file, if it wrote one


class WorkerFailedToStart(msgspec.Struct, frozen=True):
    """A rank of a launched attempt could not be started (its spawn raised). It fails the
    attempt as a worker exiting with ``exit_code`` would: 127, the shell's "cannot run"."""

    attempt: int
    local_rank: int
    message: str
    at: float
    exit_code: int = 127


class DeadlineExpired(msgspec.Struct, frozen=True):
    attempt: int
    local_rank: int
    pid: int
    scope: str
    late: float  # seconds past the deadline when noticed
    at: float


class WorkerUnhealthy(msgspec.Struct, frozen=True):
    attempt: int
    local_rank: int
    pid: int
    reason: str
    at: float


class RemoteFailure(msgspec.Struct, frozen=True):
    """Another node failed or restarted the job (multi-node). While stopping for a local
    failure: that failure was a consequence of another node's (the round's root cause was
    recorded elsewhere first), so it uses no restart budget."""

    message: str
    at: float


class PeerLost(msgspec.Struct, frozen=True):
    """While stopping for a local failure: peers of the round were confirmed gone
    (``core.peers``), so the failure came from a lost node: a membership change, with no
    restart budget used (within ``RestartPolicy.peer_loss_free``)."""

    lost: tuple[LostPeer, ...]
    at: float

    def describe(self) -> str:
        return "; ".join(p.describe() for p in self.lost)


class NodeQuarantined(msgspec.Struct, frozen=True):
    """This node is bad (K root-cause failures in the window, or its node check failed
    while the workers ran): stop, leave the rendezvous gracefully, exit EXIT_QUARANTINED."""

    message: str
    at: float


class MembershipChanged(msgspec.Struct, frozen=True):
    reason: str
    attempt: int | None = None  # the attempt whose round it outdates (None: any)


class ShutdownRequested(msgspec.Struct, frozen=True):
    signum: int


class GroupStopped(msgspec.Struct, frozen=True):
    at: float
    jitter: float = 1.0  # a uniform draw in [0, 1] for the backoff's full jitter


class BackoffElapsed(msgspec.Struct, frozen=True):
    pass


class BarrierDone(msgspec.Struct, frozen=True):
    ok: bool = True
    message: str = ""


Event = (
    RendezvousComplete
    | RendezvousFailed
    | LaunchFailed
    | GroupLaunched
    | WorkerExited
    | WorkerFailedToStart
    | DeadlineExpired
    | WorkerUnhealthy
    | RemoteFailure
    | PeerLost
    | NodeQuarantined
    | MembershipChanged
    | ShutdownRequested
    | GroupStopped
    | BackoffElapsed
    | BarrierDone
)

# -------------------------------------------------------------------------- decisions


class Nothing(msgspec.Struct, frozen=True):
    """Record the event; nothing to carry out."""


class StartRendezvous(msgspec.Struct, frozen=True):
    pass


class LaunchGroup(msgspec.Struct, frozen=True):
    attempt: int
    restart_count: int


class StopGroup(msgspec.Struct, frozen=True):
    reason: StopReason
    signum: int = signal.SIGTERM


class KillGroupNow(msgspec.Struct, frozen=True):
    """Escalate an ongoing stop: SIGKILL everything at once."""


class StartBackoff(msgspec.Struct, frozen=True):
    delay: float
    reason: str
    ceiling: float = 0.0  # the backoff's upper bound for this restart (before jitter)
    counted: bool = True  # a failure restart (job-wide budget); False: a retry of ours


class EnterExitBarrier(msgspec.Struct, frozen=True):
    pass


class Exit(msgspec.Struct, frozen=True):
    code: int
    reason: str


Decision = (
    Nothing
    | StartRendezvous
    | LaunchGroup
    | StopGroup
    | KillGroupNow
    | StartBackoff
    | EnterExitBarrier
    | Exit
)


# ------------------------------------------------------------------------------ state


class State(msgspec.Struct, frozen=True):
    """Everything the run loop decides on. Immutable; ``transition`` makes the next."""

    phase: Phase = Phase.RENDEZVOUS
    attempt: int = 0  # incarnation number: +1 for every launch, membership rounds too
    restart_count: int = 0  # failure restarts so far (TORCHELASTIC_RESTART_COUNT)
    running: frozenset[int] = frozenset()  # local ranks still alive
    stop_reason: StopReason | None = None
    shutdown_signal: int | None = None
    shutdown_requests: int = 0
    root_cause: Failure | None = None  # first failure of the current attempt
    last_failure: Failure | None = None  # kept across attempts for /status
    history: RestartHistory = msgspec.field(default_factory=RestartHistory)
    exit_code: int | None = None
    last_decision_reason: str = ""
    prepare_failures: int = 0  # attempts in a row the supervisor could not prepare


class InvalidTransition(Exception):
    """An event arrived that the current phase has no edge for."""

    def __init__(self, state: State, event: Event) -> None:
        super().__init__(f"no transition from {state.phase.value} on {type(event).__name__}")
        self.state = state
        self.event = event


class Verdict(enum.Enum):
    """What the run loop does with one event in one state."""

    EDGE = "edge"  # ``transition`` has an edge for it
    STALE = "stale"  # an earlier attempt's: logged, counted and dropped
    ERROR = "error"  # the current attempt's, with no edge: ``InvalidTransition``


# events that belong to one attempt: once another attempt runs, they are stale
AttemptEvent = (
    WorkerExited | WorkerFailedToStart | DeadlineExpired | WorkerUnhealthy | MembershipChanged
)


def is_stale(state: State, event: Event) -> bool:
    """Whether ``event`` belongs to an attempt before the current one. ``GroupLaunched``
    and ``LaunchFailed`` carry the attempt being started and are never stale."""
    if not isinstance(event, AttemptEvent):
        return False
    return event.attempt is not None and event.attempt != state.attempt


def classify(state: State, event: Event, policy: RestartPolicy) -> Verdict:
    """Edge, stale drop or error: what the controller will do with ``event``."""
    if is_stale(state, event):
        return Verdict.STALE
    try:
        transition(state, event, policy)
    except InvalidTransition:
        return Verdict.ERROR
    return Verdict.EDGE


def transition(state: State, event: Event, policy: RestartPolicy) -> tuple[State, Decision]:
    """Decide the next state and what to do, for one event."""
    if state.phase.final:
        return state, Nothing()  # late events after the end are recorded only
    if isinstance(event, ShutdownRequested):
        return _on_shutdown(state, event)
    match state.phase, event:
        # RENDEZVOUS -> STARTING
        case Phase.RENDEZVOUS, RendezvousComplete():
            count = max(state.restart_count, event.restart_count)
            return replace(state, phase=Phase.STARTING, restart_count=count), LaunchGroup(
                state.attempt + 1, count
            )
        # RENDEZVOUS -> SUCCEEDED: a spare that was never needed
        case Phase.RENDEZVOUS, RendezvousFailed() if event.job_succeeded:
            return _finish(state, Phase.SUCCEEDED, 0, event.message)
        # RENDEZVOUS -> FAILED
        case Phase.RENDEZVOUS, RendezvousFailed():
            failure = Failure(
                FailureKind.RENDEZVOUS, state.attempt, event.at, message=event.message
            )
            return _finish(state, Phase.FAILED, 1, failure.describe(), failure)
        # RENDEZVOUS: membership moved again while forming: the rendezvous task handles it
        case Phase.RENDEZVOUS, MembershipChanged() | RemoteFailure():
            return state, Nothing()
        # STARTING -> RUNNING
        case Phase.STARTING, GroupLaunched():
            return (
                replace(
                    state,
                    phase=Phase.RUNNING,
                    attempt=event.attempt,
                    running=event.local_ranks,
                    root_cause=None,
                    stop_reason=None,
                    history=state.history.started(event.at),
                    prepare_failures=0,
                ),
                Nothing(),
            )
        # STARTING -> BACKOFF (retry, no budget) or FAILED: the supervisor's own failure
        case Phase.STARTING, LaunchFailed():
            return _on_launch_failed(state, event)
        case Phase.RUNNING, WorkerExited():
            return _on_exit_running(state, event)
        # RUNNING -> STOPPING(failure): a rank that could not start fails like an exit
        case Phase.RUNNING, WorkerFailedToStart():
            failure = Failure(
                FailureKind.EXITED, event.attempt, event.at, event.local_rank,
                exit_code=event.exit_code, message=event.message,
            )
            running = state.running - {event.local_rank}
            return _stop_for(replace(state, running=running), StopReason.FAILURE, failure)
        case Phase.RUNNING, DeadlineExpired():
            msg = f"deadline '{event.scope}' expired {event.late:.3f} s ago"
            failure = Failure(
                FailureKind.DEADLINE, event.attempt, event.at, event.local_rank, event.pid,
                message=msg,
            )
            return _stop_for(state, StopReason.FAILURE, failure)
        case Phase.RUNNING | Phase.EXIT_BARRIER | Phase.STOPPING | Phase.BACKOFF, WorkerUnhealthy():
            failure = Failure(
                FailureKind.UNHEALTHY, event.attempt, event.at, event.local_rank, event.pid,
                message=event.reason,
            )
            return _stop_for(state, StopReason.FATAL, failure)
        case Phase.RUNNING, RemoteFailure():
            failure = Failure(FailureKind.REMOTE, state.attempt, event.at, message=event.message)
            return _stop_for(state, StopReason.MEMBERSHIP, failure)
        # RUNNING -> STOPPING(quarantine): the node check failed while the workers ran
        case Phase.RUNNING, NodeQuarantined():
            failure = Failure(FailureKind.NODE_CHECK, state.attempt, event.at,
                              message=event.message)
            new, decision = _stop_for(state, StopReason.QUARANTINE, failure)
            return replace(new, last_decision_reason=f"node quarantined: {event.message}"), (
                decision)
        # STOPPING(failure) -> STOPPING(membership): the failure was another node's
        case Phase.STOPPING, RemoteFailure() if state.stop_reason is StopReason.FAILURE:
            failure = Failure(FailureKind.REMOTE, state.attempt, event.at, message=event.message)
            return replace(state, stop_reason=StopReason.MEMBERSHIP, root_cause=failure,
                           last_failure=failure), Nothing()
        # STOPPING(failure) -> STOPPING(membership): a peer was lost, within the cap
        case Phase.STOPPING, PeerLost() if state.stop_reason is StopReason.FAILURE:
            return _on_peer_lost(state, event, policy)
        # a lost peer learned in any other phase: the membership watch handles it
        case _, PeerLost():
            return state, Nothing()
        # STOPPING(failure) -> STOPPING(quarantine): the K-th failure of this node
        case Phase.STOPPING, NodeQuarantined() if state.stop_reason in (
            StopReason.FAILURE, StopReason.MEMBERSHIP
        ):
            return replace(state, stop_reason=StopReason.QUARANTINE,
                           last_decision_reason=f"node quarantined: {event.message}"), Nothing()
        # RENDEZVOUS -> QUARANTINED: the check failed and nothing can take the node's place
        case Phase.RENDEZVOUS, NodeQuarantined():
            failure = Failure(FailureKind.NODE_CHECK, state.attempt, event.at,
                              message=event.message)
            return _finish(state, Phase.QUARANTINED, EXIT_QUARANTINED,
                           f"node quarantined: {event.message}", failure)
        case Phase.STOPPING | Phase.BACKOFF | Phase.EXIT_BARRIER, NodeQuarantined():
            return state, Nothing()
        case Phase.RUNNING, MembershipChanged():
            return _stop_for(state, StopReason.MEMBERSHIP, None)
        # while stopping, exits are expected and deadlines are moot
        case Phase.STOPPING, WorkerExited() | WorkerFailedToStart():
            return replace(state, running=state.running - {event.local_rank}), Nothing()
        # STOPPING: a stop decided while the launch's report was queued behind it (a
        # shutdown request that came first); that stop ends the new group as well, so
        # follow its attempt (its exits are then current, not stale) and keep stopping
        case Phase.STOPPING, GroupLaunched():
            return replace(state, attempt=event.attempt, running=event.local_ranks), Nothing()
        # STOPPING: the attempt being launched could not be prepared; nothing was started
        case Phase.STOPPING, LaunchFailed():
            return state, Nothing()
        case Phase.STOPPING, DeadlineExpired() | MembershipChanged() | RemoteFailure():
            return state, Nothing()
        case Phase.STOPPING, GroupStopped():
            return _on_group_stopped(state, event, policy)
        # BACKOFF -> RENDEZVOUS
        case Phase.BACKOFF, BackoffElapsed():
            return replace(state, phase=Phase.RENDEZVOUS), StartRendezvous()
        case Phase.BACKOFF, MembershipChanged() | RemoteFailure() | DeadlineExpired():
            return state, Nothing()
        # EXIT_BARRIER -> SUCCEEDED
        case Phase.EXIT_BARRIER, BarrierDone():
            reason = "all workers exited 0" + (f"; {event.message}" if event.message else "")
            return _finish(state, Phase.SUCCEEDED, 0, reason, None)
        case Phase.EXIT_BARRIER, MembershipChanged() | RemoteFailure() | DeadlineExpired():
            return state, Nothing()
    raise InvalidTransition(state, event)


def _on_peer_lost(state: State, event: PeerLost, policy: RestartPolicy
                  ) -> tuple[State, Decision]:
    lost = event.describe()
    if not policy.peer_loss_free(state.history, event.at):
        # STOPPING(failure) stays: past the cap, the failure counts as any other
        reason = (f"{lost} lost, but {policy.peer_loss_limit} restart(s) for lost peers in "
                  f"the last {policy.peer_loss_window:g} s were free already: this one "
                  "uses the restart budget")
        return replace(state, last_decision_reason=reason), Nothing()
    local = state.root_cause.describe() if state.root_cause is not None else "a failure"
    failure = Failure(FailureKind.NODE_LOST, state.attempt, event.at,
                      message=f"{lost}; then {local}")
    return replace(state, stop_reason=StopReason.MEMBERSHIP, root_cause=failure,
                   last_failure=failure,
                   history=policy.spend_peer_loss(state.history, event.at),
                   last_decision_reason=f"{lost} lost: a membership change, no restart "
                                        "used"), Nothing()


def _on_launch_failed(state: State, event: LaunchFailed) -> tuple[State, Decision]:
    failures = state.prepare_failures + 1
    failure = Failure(FailureKind.SUPERVISOR, event.attempt, event.at, message=event.message)
    if failures > PREPARE_RETRIES:
        reason = f"gave up after {failures} attempts could not be prepared"
        return _finish(state, Phase.FAILED, EXIT_PREPARE_FAILED, reason, failure)
    delay = prepare_retry_delay(failures)
    reason = f"retry {failures}/{PREPARE_RETRIES} in {delay:g} s: {failure.describe()}"
    state = replace(state, phase=Phase.BACKOFF, prepare_failures=failures,
                    last_failure=failure, last_decision_reason=reason)
    return state, StartBackoff(delay, reason, delay, counted=False)


def prepare_retry_delay(failures: int) -> float:
    """Seconds before retrying the ``failures``-th attempt we could not prepare."""
    return float(min(PREPARE_RETRY_MAX, 2 ** (failures - 1)))


def _on_exit_running(state: State, event: WorkerExited) -> tuple[State, Decision]:
    running = state.running - {event.local_rank}
    if event.exit_code == 0:
        state = replace(state, running=running)
        if running:  # RUNNING: one rank done, others still working
            return state, Nothing()
        # RUNNING -> EXIT_BARRIER: the whole local group succeeded
        return replace(state, phase=Phase.EXIT_BARRIER), EnterExitBarrier()
    if event.signal is not None:
        failure = Failure(
            FailureKind.SIGNALED, event.attempt, event.at, event.local_rank, event.pid,
            signal=event.signal, message=event.message,
        )
    else:
        failure = Failure(
            FailureKind.EXITED, event.attempt, event.at, event.local_rank, event.pid,
            exit_code=event.exit_code, message=event.message,
        )
    return _stop_for(replace(state, running=running), StopReason.FAILURE, failure)


def _stop_for(
    state: State, reason: StopReason, failure: Failure | None
) -> tuple[State, Decision]:
    """RUNNING -> STOPPING(reason); also upgrades an ongoing stop to FATAL."""
    if state.phase is Phase.STOPPING and reason is not StopReason.FATAL:
        return state, Nothing()
    root = state.root_cause if state.root_cause is not None else failure
    state = replace(
        state,
        phase=Phase.STOPPING,
        stop_reason=reason,
        root_cause=root,
        last_failure=root if root is not None else state.last_failure,
    )
    return state, StopGroup(reason)


def _on_shutdown(state: State, event: ShutdownRequested) -> tuple[State, Decision]:
    requests = state.shutdown_requests + 1
    if state.phase is Phase.STOPPING and requests > 1:
        # a second request while stopping: no more grace
        return replace(state, shutdown_requests=requests, stop_reason=StopReason.SHUTDOWN), (
            KillGroupNow()
        )
    new = replace(
        state,
        shutdown_requests=requests,
        shutdown_signal=event.signum,
        stop_reason=StopReason.SHUTDOWN,
    )
    if state.phase is Phase.STOPPING:
        # already stopping (failure, membership): finish that stop, then exit
        return new, Nothing()
    return replace(new, phase=Phase.STOPPING), StopGroup(StopReason.SHUTDOWN, event.signum)


def _on_group_stopped(
    state: State, event: GroupStopped, policy: RestartPolicy
) -> tuple[State, Decision]:
    state = replace(state, running=frozenset())
    match state.stop_reason:
        case StopReason.SHUTDOWN:
            # STOPPING(shutdown) -> STOPPED
            signum = state.shutdown_signal or signal.SIGTERM
            return _finish(state, Phase.STOPPED, 128 + signum, f"stopped by {signal_name(signum)}")
        case StopReason.FATAL:
            # STOPPING(fatal) -> FAILED, never restarted
            root = state.root_cause
            reason = "node unhealthy: " + (root.describe() if root else "unknown")
            return _finish(state, Phase.FAILED, root.process_exit_code if root else 1, reason)
        case StopReason.QUARANTINE:
            # STOPPING(quarantine) -> QUARANTINED: leave gracefully, never restart
            return _finish(state, Phase.QUARANTINED, EXIT_QUARANTINED,
                           state.last_decision_reason)
        case StopReason.MEMBERSHIP:
            # STOPPING(membership) -> RENDEZVOUS: no budget, no backoff
            return replace(state, phase=Phase.RENDEZVOUS, stop_reason=None), StartRendezvous()
        case StopReason.FAILURE:
            return _restart_or_fail(state, event, policy)
    raise InvalidTransition(state, event)


def _restart_or_fail(
    state: State, event: GroupStopped, policy: RestartPolicy
) -> tuple[State, Decision]:
    root = state.root_cause
    code = root.exit_code if root else None
    verdict = policy.decide(state.history, code, event.at, event.jitter, state.restart_count)
    if not verdict.restart:
        # STOPPING(failure) -> FAILED
        code = root.process_exit_code if root else 1
        reason = f"{verdict.reason}; root cause: {root.describe() if root else 'unknown'}"
        return _finish(state, Phase.FAILED, code, reason)
    # STOPPING(failure) -> BACKOFF
    state = replace(
        state,
        phase=Phase.BACKOFF,
        restart_count=state.restart_count + 1,
        history=verdict.history,
        stop_reason=None,
        last_decision_reason=verdict.reason,
    )
    return state, StartBackoff(verdict.delay, verdict.reason, verdict.ceiling)


def _finish(
    state: State, phase: Phase, code: int, reason: str, failure: Failure | None = None
) -> tuple[State, Decision]:
    if failure is not None:
        state = replace(state, root_cause=failure, last_failure=failure)
    return (
        replace(
            state, phase=phase, exit_code=code, running=frozenset(), last_decision_reason=reason
        ),
        Exit(code, reason),
    )
