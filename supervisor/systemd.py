"""systemd integration: sd_notify messages, watchdog pings and STATUS lines.

Only the standard library: the notify protocol is one datagram of ``KEY=VALUE`` lines to
the AF_UNIX socket named by ``$NOTIFY_SOCKET`` (``@name`` is the abstract namespace).
Outside systemd the variable is unset and every call is a no-op, so the daemon calls the
same methods whether or not it runs as a service.

A ``Notifier`` never raises into its caller: a failed send is logged, counted and
reported as ``False``. Losing a STATUS line must never take down a training job.

The environment is read once, at the edge, by ``Notifier.from_environ``; nothing else
here looks at ``os.environ``.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Final

import anyio
import msgspec
from anyio.abc import TaskStatus

from supervisor.core.statusview import StatusView

logger = logging.getLogger(__name__)

#: Variables systemd sets for the service's main process only. The worker environment
#: must not carry them: with NotifyAccess=main systemd ignores workers' messages anyway,
#: but a worker library that honours them (sd_notify from a training script) would log
#: noise, and WATCHDOG_PID would name the wrong process.
NOTIFY_ENV_VARS: Final = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")

#: Longest STATUS text we send; systemctl shows one line, and the socket has a size limit.
MAX_STATUS_CHARS: Final = 200

#: Default bound on how late the ping task may wake up before the loop counts as lagging.
DEFAULT_MAX_LAG: Final = 2.0


# ---------------------------------------------------------------------- parsing (pure)


class WatchdogSettings(msgspec.Struct, frozen=True):
    """The service watchdog systemd armed for us (``WatchdogSec=``)."""

    timeout_usec: int

    @property
    def timeout(self) -> float:
        return self.timeout_usec / 1_000_000

    @property
    def ping_interval(self) -> float:
        """Half the timeout, as sd_watchdog_enabled(3) recommends."""
        return self.timeout / 2


def parse_notify_socket(value: str | None) -> bytes | None:
    """``$NOTIFY_SOCKET`` to a socket address; None when unset or unusable.

    ``@name`` maps to the abstract namespace (a leading NUL byte); anything else must be
    an absolute path. vsock addresses (``vsock:CID:PORT``, VMs) are not supported.
    """
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + os.fsencode(value[1:])
    if value.startswith("/"):
        return os.fsencode(value)
    logger.warning("ignoring unsupported NOTIFY_SOCKET=%r: not notifying systemd", value)
    return None


def parse_watchdog(environ: Mapping[str, str], pid: int) -> WatchdogSettings | None:
    """The watchdog for process ``pid``, with sd_watchdog_enabled(3) semantics.

    Enabled only when ``WATCHDOG_USEC`` is a positive integer and ``WATCHDOG_PID`` is
    unset or equal to ``pid`` (the variables may have been inherited from a parent that
    is the real watched process). A malformed value disables it with a warning.
    """
    raw_usec = environ.get("WATCHDOG_USEC")
    if raw_usec is None:
        return None
    raw_pid = environ.get("WATCHDOG_PID")
    try:
        usec = int(raw_usec)
        watched = int(raw_pid) if raw_pid is not None else pid
    except ValueError:
        logger.warning("ignoring malformed WATCHDOG_USEC=%r WATCHDOG_PID=%r", raw_usec, raw_pid)
        return None
    if watched != pid:
        return None  # the watchdog belongs to another process
    if usec <= 0:
        logger.warning("ignoring non-positive WATCHDOG_USEC=%r", raw_usec)
        return None
    return WatchdogSettings(usec)


def one_line(text: str, limit: int = MAX_STATUS_CHARS) -> str:
    """Collapse whitespace (a newline would start a new assignment) and bound the length."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


# -------------------------------------------------------------------------- notifier


class Notifier:
    """Sends sd_notify(3) messages; a no-op without ``$NOTIFY_SOCKET``.

    Every method returns whether the message went out. Errors are counted in
    ``errors`` and logged once per run of failures, never raised.
    """

    def __init__(self, address: bytes | None, watchdog: WatchdogSettings | None = None) -> None:
        self.address = address
        self.watchdog_settings = watchdog if address is not None else None
        self.sent = 0
        self.errors = 0
        self._sock: socket.socket | None = None
        self._failing = False

    @classmethod
    def from_environ(
        cls, environ: Mapping[str, str] | None = None, *, pid: int | None = None
    ) -> Notifier:
        """Build from ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID``."""
        env = os.environ if environ is None else environ
        address = parse_notify_socket(env.get("NOTIFY_SOCKET"))
        watchdog = parse_watchdog(env, os.getpid() if pid is None else pid)
        return cls(address, watchdog)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *assignments: str) -> bool:
        """Send ``KEY=VALUE`` assignments as one datagram."""
        if self.address is None:
            return False
        message = "\n".join(assignments).encode("utf-8", "replace")
        try:
            self._socket().sendto(message, self.address)
        except OSError as exc:
            self._record_error(exc, assignments)
            return False
        if self._failing:
            logger.info("sd_notify works again after %d failed sends", self.errors)
            self._failing = False
        self.sent += 1
        return True

    def ready(self, status: str | None = None) -> bool:
        """Start-up is complete (``READY=1``), optionally with a STATUS line."""
        return self.send("READY=1", *self._status_field(status))

    def status(self, text: str) -> bool:
        """Free-form one-line status shown by ``systemctl status``."""
        return self.send(*self._status_field(text))

    def stopping(self, status: str | None = None) -> bool:
        """Shutdown has begun (``STOPPING=1``)."""
        return self.send("STOPPING=1", *self._status_field(status))

    def extend_timeout(self, usec: int) -> bool:
        """Ask for ``usec`` more microseconds on the current start or stop timeout."""
        return self.send(f"EXTEND_TIMEOUT_USEC={max(0, int(usec))}")

    def watchdog(self) -> bool:
        """Keep-alive ping for ``WatchdogSec=`` (``WATCHDOG=1``)."""
        return self.send("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _socket(self) -> socket.socket:
        if self._sock is None:
            # Python sockets are close-on-exec, so workers never inherit it. Non-blocking:
            # if systemd's queue is full we drop a message rather than stall the loop.
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.setblocking(False)
            self._sock = sock
        return self._sock

    @staticmethod
    def _status_field(text: str | None) -> tuple[str, ...]:
        return () if text is None else (f"STATUS={one_line(text)}",)

    def _record_error(self, exc: OSError, assignments: tuple[str, ...]) -> None:
        self.errors += 1
        first = assignments[0].split("=", 1)[0] if assignments else "?"
        if self._failing:
            logger.debug("sd_notify %s failed again: %s", first, exc)
            return
        self._failing = True
        logger.warning("sd_notify %s to NOTIFY_SOCKET failed: %s", first, exc)


# ---------------------------------------------------------------------- lag detection


class LagProbe:
    """Judges how late event-loop wake-ups are against ``max_lag`` seconds.

    The watchdog ping task feeds it the lateness of each of its own wake-ups; the health
    server may read ``last_lag`` for its liveness verdict. Plain counters, no I/O.
    """

    def __init__(self, max_lag: float = DEFAULT_MAX_LAG) -> None:
        if not max_lag > 0:
            raise ValueError(f"max_lag must be positive, got {max_lag!r}")
        self.max_lag = max_lag
        self.last_lag = 0.0
        self.worst_lag = 0.0
        self.late_wakeups = 0
        self.lagging_since: float | None = None

    def observe(self, lateness: float, now: float) -> bool:
        """Record one wake-up; True when it was on time."""
        self.last_lag = lateness
        self.worst_lag = max(self.worst_lag, lateness)
        if lateness <= self.max_lag:
            if self.lagging_since is not None:
                logger.info(
                    "event loop on time again after %.1f s of lag", now - self.lagging_since
                )
                self.lagging_since = None
            return True
        self.late_wakeups += 1
        if self.lagging_since is None:
            self.lagging_since = now - lateness
            logger.warning(
                "event loop woke %.3f s late (bound %.3f s): withholding watchdog pings",
                lateness,
                self.max_lag,
            )
        return False


def _lag_probe(lag: LagProbe | float | None, interval: float) -> LagProbe:
    if isinstance(lag, LagProbe):
        return lag
    if lag is None:
        # Half the ping interval at most, so one on-time wake-up still fits in the timeout.
        return LagProbe(min(DEFAULT_MAX_LAG, interval / 2))
    return LagProbe(lag)


async def run_watchdog_pings(
    notifier: Notifier,
    lag: LagProbe | float | None = None,
    *,
    task_status: TaskStatus[float | None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Send ``WATCHDOG=1`` every ``WATCHDOG_USEC / 2`` while the event loop keeps time.

    A ping goes out only from a wake-up that was at most ``lag`` seconds late (a
    ``LagProbe``, a bound in seconds, or None for ``min(2 s, interval / 2)``). After a
    late wake-up the task re-checks every ``bound / 2`` and pings at the first on-time
    one, so a single stall costs nothing, but a loop that stays wedged or sluggish
    sends nothing and systemd kills it after ``WatchdogSec=``.

    Reports ``started(interval)``, or ``started(None)`` and returns at once when systemd
    armed no watchdog for this process.
    """
    settings = notifier.watchdog_settings
    if settings is None:
        task_status.started(None)
        return
    interval = settings.ping_interval
    probe = _lag_probe(lag, interval)
    notifier.watchdog()  # arms systemd's timer now, even before READY=1
    task_status.started(interval)
    while True:
        await _sleep_on_time(interval, probe)
        notifier.watchdog()


async def _sleep_on_time(delay: float, probe: LagProbe) -> None:
    """Sleep ``delay`` seconds, then until a wake-up arrives within the probe's bound."""
    recheck = max(probe.max_lag / 2, 0.001)
    deadline = anyio.current_time() + delay
    while True:
        await anyio.sleep_until(deadline)
        now = anyio.current_time()
        if probe.observe(now - deadline, now):
            return
        deadline = now + recheck


@asynccontextmanager
async def extending_timeout(notifier: Notifier, step: float = 5.0) -> AsyncIterator[None]:
    """While the body runs, keep asking systemd for ``2 * step`` more seconds.

    Wrap a graceful stop that may outlast ``TimeoutStopSec=`` (a long shutdown grace),
    or a start phase that may outlast ``TimeoutStartSec=``. systemd never shortens a
    timeout for this message. If the loop wedges, the extensions stop and the timeout
    fires at the configured time or ``2 * step`` after the last extension, whichever
    is later.
    """
    if not notifier.enabled:
        yield
        return
    error: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(_extend_every, notifier, step)
        try:
            yield
        except Exception as exc:
            # Raised again below, outside the task group, so the caller sees the body's
            # own exception rather than an ExceptionGroup around it.
            error = exc
        finally:
            tg.cancel_scope.cancel()
    if error is not None:
        raise error


async def _extend_every(notifier: Notifier, step: float) -> None:
    usec = math.ceil(2 * step * 1_000_000)
    while True:
        notifier.extend_timeout(usec)
        await anyio.sleep(step)


# ----------------------------------------------------------------------- STATUS lines

_FINAL_PHASES: Final = frozenset({"succeeded", "failed", "stopped", "quarantined"})


class StatusReporter:
    """Turns the read model's published status views into READY, STATUS and STOPPING.

    - ``STATUS=`` whenever the line changes (``snap.status_line``, else ``format_status``);
    - ``READY=1`` once, with the first view after a group launched (it lists
      workers), so a reader that skips intermediate views still sends it;
    - ``STOPPING=1`` once, at ``stopping()`` (call it on a shutdown request) or at the
      first final phase, whichever comes first.
    """

    def __init__(self, notifier: Notifier) -> None:
        self.notifier = notifier
        self._last = ""
        self._ready = False
        self._stopping = False

    def publish(self, snap: StatusView) -> None:
        line = snap.status_line or format_status(snap)
        spare = bool(snap.node_health and snap.node_health.get("spare"))
        if not self._ready and (snap.workers or spare):  # a spare is up: it waits, warm
            self._ready = True
            self._last = line
            self.notifier.ready(line)
        if snap.phase in _FINAL_PHASES:
            self.stopping(line)
        elif line != self._last:
            self._last = line
            self.notifier.status(line)

    def stopping(self, status: str | None = None) -> None:
        """Tell systemd the shutdown has begun; later calls only update STATUS."""
        first = not self._stopping
        self._stopping = True
        if first:
            self.notifier.stopping(status)
        elif status is not None and status != self._last:
            self.notifier.status(status)
        if status is not None:
            self._last = status


def format_status(snap: StatusView) -> str:
    """One STATUS line for ``systemctl status``, e.g.
    ``running attempt 2: 8/8 workers, restarts 1/3``."""
    restarts = f"restarts {snap.restart_count}/{snap.max_restarts}"
    total = snap.local_world_size or len(snap.workers)
    running = sum(1 for w in snap.workers if w.state == "running")
    failure = _failure_text(snap)
    match snap.phase:
        case "rendezvous":
            text = f"rendezvous round {snap.rendezvous.round}, {restarts}"
        case "starting":
            text = f"starting {total} workers, {restarts}"
        case "running":
            text = f"running attempt {snap.attempt}: {running}/{total} workers, {restarts}"
        case "exit_barrier":
            done = sum(1 for w in snap.workers if w.state == "succeeded")
            text = f"exit barrier after attempt {snap.attempt}: {done}/{total} workers done"
        case "stopping":
            text = f"stopping attempt {snap.attempt}: {running}/{total} workers left{failure}"
        case "backoff":
            text = f"backoff after attempt {snap.attempt}, {restarts}{failure}"
        case "succeeded":
            text = f"succeeded after attempt {snap.attempt}"
        case "failed":
            text = f"failed after attempt {snap.attempt}, exit code {snap.exit_code}{failure}"
        case "stopped":
            text = f"stopped, exit code {snap.exit_code}"
        case "quarantined":
            text = f"quarantined after attempt {snap.attempt}, exit code {snap.exit_code}"
        case _:
            text = f"{snap.phase} attempt {snap.attempt}, {restarts}"
    return one_line(text)


def _failure_text(snap: StatusView) -> str:
    """The current attempt's root cause, to say why a stop or backoff is happening."""
    failure = snap.last_failure
    if failure is None or failure.attempt != snap.attempt:
        return ""
    return f": {failure.description or failure.message or failure.kind}"
