"""Prometheus metrics for one supervisor, in a private registry.

Two kinds of series:

- **Counters and histograms of events.** ``Metrics`` plugs into the code that sees them
  through the narrow seams that code already has: it is a controller ``Observer``
  (``on_transition`` counts worker exits, failures, restarts and rendezvous rounds). The
  HTTP server counts its own requests. Counts kept by their owners, which exist (and
  count) before the metrics do, are read at scrape time: the watchdog's ``WatchdogStats``
  (given at construction), loop stalls, event-log and output losses (``watch_*``).
- **Gauges of current state** (phase, workers up, attempt, restarts, world size, loop
  lag, last progress age per rank). These are derived at scrape time from the published
  view by ``observe``, so they can never drift from what ``/status`` says.

Each ``Metrics`` has its own ``CollectorRegistry``: several supervisors may live in one
test process, and the global registry would mix them.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import Enum as EnumMetric
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.registry import Collector

from supervisor.core import health
from supervisor.core import state as sm
from supervisor.core.goodput import CAUSES, Ledger, totals
from supervisor.core.statusview import StatusView
from supervisor.watchdog.timers import WatchdogStats

if TYPE_CHECKING:
    from supervisor.workers.spawn import Start
    from supervisor.workers.warm.memory import MemorySample

NAMESPACE = "elastic_supervisor"

WORKER_OUTCOMES = ("succeeded", "failed", "signaled", "stopped")
"""Worker exit outcomes: 0, non-zero, killed by a signal, or exited while being stopped."""

HTTP_PATHS = ("/healthz", "/readyz", "/status", "/metrics", "/openapi.json", "/leave-notice")
OTHER_PATH = "other"

_PHASES = tuple(p.value for p in sm.Phase)
_RENDEZVOUS_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0)
_RECOVERY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
_FAILURE_KINDS = tuple(k.value for k in sm.FailureKind)


class StallCounts(Protocol):
    """What ``health.looplag.LoopLag`` counts about stalls of the loop."""

    stalls: int
    stalled_seconds: float


class EventLogCounts(Protocol):
    """What ``events.EventLog`` counts about events it could not write."""

    @property
    def dropped(self) -> int: ...

    @property
    def pending(self) -> int: ...


class OutputLossCounts(Protocol):
    """What the worker output pipeline counts about output it could not write."""

    @property
    def lost_bytes(self) -> int: ...

    @property
    def write_errors(self) -> int: ...


class WarmCosts(Protocol):
    """What the warm pool tells of the fork server (``warm.pool.Pool``)."""

    def memory(self) -> MemorySample | None: ...

    def fork_failures(self) -> dict[str, int]: ...


class _Pulled(Collector):
    """Series read at scrape time from an object that counts on its own (it exists, and
    counts, before the metrics do: they are created after the first launch)."""

    def __init__(self, read: Callable[[], Iterable[Metric]]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        return list(self._read())


def _counter_family(name: str, doc: str, value: float) -> Metric:
    return CounterMetricFamily(f"{NAMESPACE}_{name}", doc, value=value)


def _labelled_counters(name: str, doc: str, label: str, values: Mapping[str, int]) -> Metric:
    family = CounterMetricFamily(f"{NAMESPACE}_{name}", doc, labels=(label,))
    for key, value in sorted(values.items()):
        family.add_metric((key,), value)
    return family


class Metrics:
    """All metrics of one supervisor; ``render()`` gives the Prometheus text."""

    content_type = CONTENT_TYPE_PLAIN_0_0_4

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        started: float | None = None,
        watchdog: WatchdogStats | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._clock = clock
        # the watchdog's own counts (it counts before the metrics exist), else ours
        self._watchdog = watchdog if watchdog is not None else WatchdogStats()
        # the supervisor starts in RENDEZVOUS: the first round is timed from its start
        # (``started``, when the metrics are created later and replay the transitions)
        self._rendezvous_since = clock() if started is None else started
        self._make_run_counters()
        self._make_watchdog_counters()
        self._make_state_gauges()
        self._make_goodput_metrics()
        self._make_heap_metrics()

    # ------------------------------------------------------------------ construction

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(name, doc, labels, namespace=NAMESPACE, registry=self.registry)

    def _gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(name, doc, labels, namespace=NAMESPACE, registry=self.registry)

    def _make_run_counters(self) -> None:
        self.restarts = self._counter("restarts", "Worker group restarts, by reason.", ("reason",))
        for reason in (*_FAILURE_KINDS, "membership"):  # at zero: increase() sees the first
            self.restarts.labels(reason)
        self.failures = self._counter("failures", "Root-cause failures, by kind.", ("kind",))
        for kind in _FAILURE_KINDS:  # every kind at zero: alerts and panels need the series
            self.failures.labels(kind)
        self.worker_exits = self._counter(
            "worker_exits", "Worker process exits, by outcome.", ("outcome",)
        )
        for outcome in WORKER_OUTCOMES:
            self.worker_exits.labels(outcome)
        self.rendezvous_rounds = self._counter("rendezvous_rounds", "Completed rendezvous rounds.")
        self.rendezvous_duration = Histogram(
            "rendezvous_duration_seconds", "Time to complete a rendezvous round.",
            namespace=NAMESPACE, registry=self.registry, buckets=_RENDEZVOUS_BUCKETS,
        )
        self.http_requests = self._counter(
            "http_requests", "HTTP requests served, by path and status code.", ("path", "code")
        )
        self.warm_starts = self._counter(
            "warm_starts", "Workers started in their rank's standby (warm restarts)."
        )
        self.cold_fallbacks = self._counter(
            "standby_cold_fallbacks",
            "Workers started cold although their rank had a standby, by reason.", ("reason",),
        )
        for reason in ("env_changed", "preload_failed", "other"):
            self.cold_fallbacks.labels(reason)
        self.prepare_failures = self._counter(
            "attempt_prepare_failures",
            "Attempts the supervisor could not prepare (its own failure: full disk...).",
        )
        self.http_evictions = self._counter(
            "http_connections_evicted",
            "Health connections closed at the connection cap before sending a request.",
        )
        self.http_refusals = self._counter(
            "http_connections_refused",
            "Health connections closed on arrival: every other one was handling a request.",
        )
        # counted by the read model (it exists before the metrics): read from the view
        self._stale_events = 0
        self.registry.register(_Pulled(lambda: [_counter_family(
            "stale_events_dropped", "Events of an earlier attempt dropped (a late exit or "
            "deadline of a group already replaced).", self._stale_events)]))

    def _make_watchdog_counters(self) -> None:
        counts = self._watchdog

        def read() -> Iterable[Metric]:
            yield _counter_family("watchdog_accepted_requests",
                                  "Watchdog FIFO requests accepted.", counts.accepted)
            yield _labelled_counters("watchdog_rejected_requests",
                                     "Watchdog FIFO requests dropped, by reason.", "reason",
                                     counts.rejected)
            yield _labelled_counters("deadline_expirations",
                                     "Watchdog deadlines that expired, by outcome.", "outcome",
                                     counts.expired)

        self.registry.register(_Pulled(read))

    def _make_state_gauges(self) -> None:
        self.state = EnumMetric(
            "state", "Current phase of the supervisor's run loop.",
            namespace=NAMESPACE, registry=self.registry, states=list(_PHASES),
        )
        self.workers_up = self._gauge("workers_up", "Local workers currently running.")
        self.attempt = self._gauge("attempt", "Current attempt (incarnation) number.")
        self.restart_count = self._gauge("restart_count", "Failure restarts used so far.")
        self.restarts_left = self._gauge("restarts_left", "Failure restarts left in the budget.")
        self.world_size = self._gauge("world_size", "Global number of workers.")
        self.rendezvous_round = self._gauge("rendezvous_round", "Current rendezvous round.")
        self.loop_lag = self._gauge("event_loop_lag_seconds", "Measured event-loop lag.")
        self.progress_age = self._gauge(
            "last_progress_age_seconds", "Seconds since a local rank last reported progress.",
            ("local_rank",),
        )

    def _make_goodput_metrics(self) -> None:
        # totals are derived from the published ledger at scrape time (GoodputCollector)
        self.goodput = GoodputCollector()
        self.registry.register(self.goodput)
        self.recovery_seconds = Histogram(
            "recovery_seconds", "Time lost per failure, from the failure until every awaited "
            "rank showed progress again (recovered failures only), by cause.", ("cause",),
            namespace=NAMESPACE, registry=self.registry, buckets=_RECOVERY_BUCKETS,
        )
        self.unrecovered = self._counter(
            "unrecovered_failures", "Failures the run never recovered from, by cause.", ("cause",)
        )
        for cause in CAUSES:
            self.recovery_seconds.labels(cause)
            self.unrecovered.labels(cause)
        self.ready = self._gauge("ready", "1 while /readyz would answer 200, else 0.")
        self.live = self._gauge("live", "1 while /healthz would answer 200, else 0.")
        self.max_restarts = self._gauge("max_restarts", "The failure restart budget.")
        self.progress_timeout = self._gauge(
            "progress_timeout_seconds", "Silence after which a rank's progress is stale."
        )
        self.awaiting_progress = self._gauge(
            "awaiting_progress_ranks", "Local ranks readiness still waits to see progress from."
        )

    def record_recovery(self, cause: str, seconds: float, recovered: bool) -> None:
        """A failure record closed: observe its recovery time (or count it unrecovered)."""
        if recovered:
            self.recovery_seconds.labels(cause).observe(max(0.0, seconds))
        else:
            self.unrecovered.labels(cause).inc()

    # ------------------------------------------------------ controller Observer seam

    def on_transition(
        self, old: sm.State, new: sm.State, event: sm.Event, decision: sm.Decision
    ) -> None:
        """Count what one state-machine step means (called by the controller after it)."""
        if isinstance(event, sm.WorkerExited | sm.WorkerFailedToStart):
            self.record_worker_exit(_exit_outcome(old, event))
        if isinstance(event, sm.LaunchFailed):
            self.prepare_failures.inc()
        if new.root_cause is not None and new.root_cause is not old.root_cause:
            self.failures.labels(new.root_cause.kind.value).inc()
        reason = _restart_reason(old, new, decision)
        if reason is not None:
            self.record_restart(reason)
        self._time_rendezvous(old, new, event)

    def on_launch(self, attempt: object) -> None:
        """Count warm starts and standbys that could not be used (controller ``Observer``)."""
        for worker in getattr(attempt, "workers", ()):
            start: Start = worker.start
            if start.warm:
                self.warm_starts.inc()
            elif start.cold_reason is not None:
                self.cold_fallbacks.labels(start.cold_reason).inc()

    def on_stopped(self, attempt: object) -> None:
        """Controller ``Observer`` hook; gauges come from the view instead."""

    def _time_rendezvous(self, old: sm.State, new: sm.State, event: sm.Event) -> None:
        if isinstance(event, sm.RendezvousComplete):
            self.record_rendezvous(self._clock() - self._rendezvous_since)
        elif new.phase is sm.Phase.RENDEZVOUS and old.phase is not sm.Phase.RENDEZVOUS:
            self._rendezvous_since = self._clock()

    # -------------------------------------------------------- watchdog metrics seam

    def request_accepted(self) -> None:
        """A watchdog request was accepted (it counts as worker progress)."""
        self._watchdog.request_accepted()

    def request_rejected(self, reason: str) -> None:
        """A watchdog request was dropped (malformed, oversized, unknown pid, ...)."""
        self._watchdog.request_rejected(reason)

    def deadline_expired(self, outcome: str) -> None:
        """A watchdog deadline expired; ``outcome`` says what became of the worker."""
        self._watchdog.deadline_expired(outcome)

    # ------------------------------------------------------------ direct recording

    def record_restart(self, reason: str) -> None:
        """A restart of the worker group was decided (failure kind, or ``membership``)."""
        self.restarts.labels(reason).inc()

    def record_worker_exit(self, outcome: str) -> None:
        """A worker process exited (``outcome``: one of ``WORKER_OUTCOMES``)."""
        self.worker_exits.labels(outcome).inc()

    def record_rendezvous(self, duration: float) -> None:
        """A rendezvous round completed after ``duration`` seconds."""
        self.rendezvous_rounds.inc()
        self.rendezvous_duration.observe(max(0.0, duration))

    def record_http_request(self, path: str, code: int) -> None:
        """One HTTP request was answered; unknown paths share one label value."""
        label = path if path in HTTP_PATHS else OTHER_PATH
        self.http_requests.labels(label, str(code)).inc()

    def record_http_eviction(self) -> None:
        """A waiting connection was closed to make room for a new one at the cap."""
        self.http_evictions.inc()

    def record_http_refusal(self) -> None:
        """A new connection was closed on arrival: the cap was full of busy ones."""
        self.http_refusals.inc()

    # ------------------------------------------------- counts kept by their owners

    def _make_heap_metrics(self) -> None:
        """The collector's full collections and the start-up heap frozen out of its reach
        (``serving.freeze_heap``): a full collection holds the event loop while it runs. Both
        are the process's (shared by the supervisors of one process, under the Python API)."""

        def read() -> Iterable[Metric]:
            yield _counter_family("gc_full_collections", "Full (generation 2) collections of "
                                  "the supervisor's heap; each holds the event loop.",
                                  gc.get_stats()[2]["collections"])
            yield GaugeMetricFamily(f"{NAMESPACE}_gc_frozen_objects", "Objects of the "
                                    "start-up moved out of the collector's reach (gc.freeze).",
                                    value=gc.get_freeze_count())

        self.registry.register(_Pulled(read))

    def watch_loop(self, lag: StallCounts) -> None:
        """Export the loop's stall counts (``event_loop_stalls_total``, ``..._seconds``)."""

        def read() -> Iterable[Metric]:
            yield _counter_family("event_loop_stalls", "Stalls of the event loop (or suspends "
                                  "of the machine) longer than the stall threshold.", lag.stalls)
            yield _counter_family("event_loop_stalled_seconds", "Seconds the event loop "
                                  "stood still in those stalls.", lag.stalled_seconds)

        self.registry.register(_Pulled(read))

    def watch_event_log(self, log: EventLogCounts) -> None:
        """Export events the event log could not write (disk full): dropped and pending."""

        def read() -> Iterable[Metric]:
            yield _counter_family("events_dropped", "Events lost: the event log could not "
                                  "write them and its buffer was full.", log.dropped)
            yield GaugeMetricFamily(f"{NAMESPACE}_events_pending", "Events held in memory "
                                    "until the event log can be written again.", value=log.pending)

        self.registry.register(_Pulled(read))

    def watch_output(self, output: OutputLossCounts) -> None:
        """Export worker output that could not be written to the log files."""

        def read() -> Iterable[Metric]:
            yield _counter_family("output_lost_bytes", "Bytes of worker output that could "
                                  "not be written to their log files.", output.lost_bytes)
            yield _counter_family("output_write_errors", "Failed writes of worker output to "
                                  "log files.", output.write_errors)

        self.registry.register(_Pulled(read))

    def watch_warm(self, pool: WarmCosts) -> None:
        """Export the fork server's RSS, each forked standby's USS (the last sample, taken
        off the loop at most every 10 s) and the fork servers that failed."""

        def read() -> Iterable[Metric]:
            sample = pool.memory()
            rss = GaugeMetricFamily(f"{NAMESPACE}_fork_server_rss_bytes", "Resident memory "
                                    "of the node's fork server (last sample).")
            if sample is not None and sample.server_rss is not None:
                rss.add_metric([], sample.server_rss)
            yield rss
            uss = GaugeMetricFamily(f"{NAMESPACE}_standby_uss_bytes", "Memory only this "
                                    "forked standby holds (USS, last sample).",
                                    labels=["local_rank"])
            for rank, value in sorted((sample.standby_uss if sample else {}).items()):
                uss.add_metric([str(rank)], value)
            yield uss
            failures = CounterMetricFamily(f"{NAMESPACE}_fork_server_failures", "Fork "
                                           "servers that failed (cold starts followed), by "
                                           "reason.", labels=["reason"])
            for reason, count in sorted(pool.fork_failures().items()):
                failures.add_metric([reason], count)
            yield failures

        self.registry.register(_Pulled(read))

    # ----------------------------------------------------------------------- state

    def observe(
        self,
        view: StatusView,
        progress: Mapping[int, float],
        now_mono: float,
        loop_lag: float,
    ) -> None:
        """Set the state gauges from the current view (called at scrape time)."""
        if view.phase in _PHASES:
            self.state.state(view.phase)
        self.workers_up.set(sum(1 for w in view.workers if w.state == "running"))
        self.attempt.set(view.attempt)
        self.restart_count.set(view.restart_count)
        self.restarts_left.set(view.restarts_left)
        self.world_size.set(view.world_size)
        self.rendezvous_round.set(view.rendezvous.round)
        self._stale_events = view.stale_events
        self.loop_lag.set(loop_lag)
        self._observe_progress(progress, now_mono)
        self.goodput.observe(view.goodput, now_mono)

    def observe_readiness(
        self,
        view: StatusView,
        progress: Mapping[int, float],
        now_mono: float,
        loop_lag: float,
        *,
        shown: Collection[int],
        expected: Collection[int],
        max_loop_lag: float = health.DEFAULT_MAX_LOOP_LAG,
    ) -> None:
        """Set the readiness gauges as ``/readyz`` and ``/healthz`` would judge now."""
        verdict = health.ready_and_live(
            view, progress, now_mono, loop_lag, shown=shown, expected=expected,
            max_loop_lag=max_loop_lag,
        )
        self.ready.set(1 if verdict.ok else 0)
        alive = health.liveness(view, progress, now_mono, loop_lag,
                                max_loop_lag=max_loop_lag)
        self.live.set(1 if alive.ok else 0)
        self.max_restarts.set(view.max_restarts)
        self.progress_timeout.set(view.progress_timeout)
        self.awaiting_progress.set(
            len(health.awaited_ranks(view, shown, expected, now_mono))
        )

    def _observe_progress(self, progress: Mapping[int, float], now_mono: float) -> None:
        # ranks of a previous attempt must disappear, so rebuild the labelled series
        self.progress_age.clear()
        for rank, last in sorted(progress.items()):
            self.progress_age.labels(str(rank)).set(max(0.0, now_mono - last))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric in this registry."""
        return generate_latest(self.registry)


class GoodputCollector(Collector):
    """Goodput totals as counters, computed from the latest ledger when scraped.

    Every cause's ``lost_seconds_total`` series exists from the start (at zero), so
    dashboards and alerts see it before the first failure of that cause.

    The accountant may move time between kinds after the fact: a hang is noticed at its
    deadline, but the time since the rank's last progress was lost, not productive. A
    counter must never go down (Prometheus would take it for a reset), so each series
    exports the highest value it ever had: after such a correction it stays flat until
    the true total catches up. ``/status`` shows the true totals.
    """

    def __init__(self) -> None:
        self._ledger: Ledger | None = None
        self._now = 0.0
        self._high: dict[tuple[str, str], float] = {}

    def observe(self, ledger: Ledger | None, now_mono: float) -> None:
        """Remember the ledger to render on the next collection."""
        self._ledger = ledger
        self._now = now_mono

    def describe(self) -> Iterator[Metric]:
        return iter(self._families(None, 0.0, every=True))

    def collect(self) -> Iterator[Metric]:
        families = self._families(self._ledger, self._now)
        for family in families:
            if family.type != "counter":
                continue
            for i, sample in enumerate(family.samples):
                key = (sample.name, ",".join(sample.labels.values()))
                high = max(self._high.get(key, 0.0), sample.value)
                self._high[key] = high
                family.samples[i] = sample._replace(value=high)
        return iter(families)

    @staticmethod
    def _families(ledger: Ledger | None, now: float, *, every: bool = False) -> list[Metric]:
        """The families to export; a figure that cannot be known is absent (not 0): until
        some rank shows progress, start-up, productive and lost time, and the ratio while
        any time is unknown. ``every``: all of them (their descriptions)."""
        t = totals(ledger, now) if ledger is not None else None
        seen = every or (t is not None and t.seen)
        known = every or (t is not None and t.known)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"{NAMESPACE}_{name}", doc, value=value)

        lost = CounterMetricFamily(
            f"{NAMESPACE}_lost_seconds", "Wall time lost to failures and membership changes "
            "(failure until progress resumed), by cause.", labels=("cause",),
        )
        for cause in CAUSES:
            lost.add_metric((cause,), t.lost_by_cause.get(cause, 0.0) if t else 0.0)
        ratio = GaugeMetricFamily(
            f"{NAMESPACE}_goodput_ratio", "Effective training time ratio: productive / wall.",
            value=(t.ratio or 0.0) if t else 0.0,
        )
        families: list[Metric] = [
            counter("idle_seconds", "Wall time neither productive nor lost (exit barrier, "
                    "shutdown).", t.idle if t else 0.0),
            counter("wall_seconds", "Wall time accounted since the supervisor started.",
                    t.wall if t else 0.0),
            counter("unknown_seconds", "Wall time after a launch while no rank had a "
                    "progress signal (productive or lost: not seen).", t.unknown if t else 0.0),
        ]
        if seen:
            families[:0] = [
                counter("productive_seconds", "Wall time with every awaited rank progressing.",
                        t.productive if t else 0.0),
                counter("startup_seconds", "Wall time before the first attempt's progress.",
                        t.startup if t else 0.0),
            ]
            families.append(lost)
        if known:
            families.append(ratio)
        return families


def _exit_outcome(old: sm.State, event: sm.WorkerExited | sm.WorkerFailedToStart) -> str:
    if isinstance(event, sm.WorkerFailedToStart):
        return "stopped" if old.phase is sm.Phase.STOPPING else "failed"  # as exit 127
    if event.exit_code == 0:
        return "succeeded"
    if old.phase is sm.Phase.STOPPING:
        return "stopped"  # we asked it to stop; not a failure of its own
    return "signaled" if event.signal is not None else "failed"


def _restart_reason(old: sm.State, new: sm.State, decision: sm.Decision) -> str | None:
    if isinstance(decision, sm.StartBackoff):
        if not decision.counted:
            return None  # a retry of the supervisor's own preparation, not a restart
        return new.root_cause.kind.value if new.root_cause is not None else "unknown"
    if (
        isinstance(decision, sm.StartRendezvous)
        and old.phase is sm.Phase.STOPPING
        and old.stop_reason is sm.StopReason.MEMBERSHIP
    ):
        return "membership"
    return None
