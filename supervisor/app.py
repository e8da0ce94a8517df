"""The composition root: one task group, every long-lived task started with ``tg.start``.

``supervise`` reads as start-up, serve, shut down. Order matters and is visible there:
first the start-up checks of everything the outside world can refuse (one line and exit
2 each; the health port is bound and the rendezvous reached among them: ``startup``),
then every part is made (``wiring``), then signal handlers (before any worker exists),
the watchdog (FIFO open) and the health endpoint start, then the controller, which
launches the first group; systemd hears READY=1 only after that.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping

import anyio
import anyio.to_thread
from anyio.abc import TaskGroup, TaskStatus

from supervisor.config import ConfigError, Settings, advisories
from supervisor.controller import (
    CommandFor,
    CpusFor,
    ForwardSignal,
    Outbox,
    ReopenLogs,
    StatusHub,
)
from supervisor.core import state as sm
from supervisor.discovery import announce, local_url
from supervisor.logsetup import configure_logging
from supervisor.priority import describe as describe_priority
from supervisor.priority import raise_loop_priority
from supervisor.rendezvous.base import Rendezvous, RendezvousError
from supervisor.rendezvous.registry import (
    backend_advisories,
)
from supervisor.serving import freeze_when_launched, serve_when_launched
from supervisor.startup import (
    STOP_SIGNALS,
    Outside,
    StoppedBeforeStart,
    check_start,
    reach_outside,
)
from supervisor.systemd import (
    StatusReporter,
    run_watchdog_pings,
)
from supervisor.views import RunResult
from supervisor.wiring import Daemon, Hooks, wire
from supervisor.workers.spawn import SPAWNER

logger = logging.getLogger(__name__)

FORWARD_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def run_supervisor(settings: Settings, environ: Mapping[str, str] | None = None) -> int:
    """Run the daemon until the job ends; return the process exit code."""
    env = dict(os.environ if environ is None else environ)
    configure_logging(settings.log_level, settings.log_format)
    faulthandler.enable()  # a watchdog SIGABRT then leaves every thread's stack in the log
    SPAWNER.start()  # every child is forked from it (spawn.Spawner says why)
    try:
        return anyio.run(supervise, settings, env).exit_code
    except ConfigError as exc:
        return _config_error(exc)
    except StoppedBeforeStart as exc:
        return 128 + exc.signum
    except BaseExceptionGroup as group:
        # a start-up error raised inside the task group arrives wrapped: one line, still
        matched, rest = group.split(ConfigError)
        if matched is None or rest is not None:
            raise
        return _config_error(_first_leaf(matched))
    finally:
        SPAWNER.stop()  # last: every child of ours is reaped by now


def _config_error(exc: BaseException) -> int:
    print(f"elastic-supervisor: config error: {exc}", file=sys.stderr)
    return 2


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


async def supervise(
    settings: Settings,
    environ: dict[str, str],
    *,
    command: CommandFor | None = None,
    cpus: CpusFor | None = None,
    embedded: bool = False,
) -> RunResult:
    """Compose and run every task; returns how the run ended (exit code, root cause).

    ``embedded`` is the Python API's mode: the supervisor runs inside someone else's
    process, so it installs no signal handlers, does not become a child subreaper (the
    host's other children are not ours to sweep) and does not talk to systemd.
    ``command`` and ``cpus`` override how each rank's command line and CPU binding are made.
    """
    plan = check_start(settings, environ, command=command, cpus=cpus)  # exit 2, nothing made
    hooks = Hooks()  # for what reports before those it reports to exist (below)
    outside = await reach_outside(plan, environ, on_etcd_event=hooks.etcd_event,
                                  embedded=embedded)
    daemon: Daemon | None = None
    try:
        daemon = wire(plan, outside, environ, hooks, command=command, embedded=embedded)
        announce_start(daemon)
        async with anyio.create_task_group() as tg:
            await start_tasks(tg, daemon)
            result = await daemon.controller.run(daemon.inbox, daemon.outbox)
            await wind_down(daemon)
            tg.cancel_scope.cancel()
    finally:
        await close(outside, daemon)
    return result


# ------------------------------------------------------------------ start-up


def announce_start(daemon: Daemon) -> None:
    """The start-up's last lines: advisories, the loop's priority, ``supervisor_started``."""
    settings = daemon.settings
    # after the checks: a failed start is one line
    for level, note in (*advisories(settings), *backend_advisories(settings)):
        logger.log(level, "%s", note)
    if not daemon.embedded:  # this thread runs the loop; the spawner (workers) stays at nice 0
        priority = raise_loop_priority(settings.loop_nice)  # /healthz ahead of a restart
        logger.log(logging.DEBUG if settings.loop_nice == 0 else logging.INFO, "%s",
                   describe_priority(priority))
    daemon.records.events.emit(
        "supervisor_started", pid=os.getpid(), log_dir=str(daemon.log_root),
        local_world_size=settings.local_world_size, backend=settings.rdzv_backend)
    logger.info("run %s: logs under %s", daemon.run_id, daemon.log_root / daemon.run_id)


# ------------------------------------------------------------------ serve


async def start_tasks(tg: TaskGroup, daemon: Daemon) -> None:
    """Every long-lived task, each started only once the one before it is ready: signal
    handlers before any worker exists, the FIFO open before the first launch."""
    d = daemon
    if not d.embedded:
        await tg.start(deliver_signals, d.outbox)
    await tg.start(run_watchdog_pings, d.records.notifier)
    await tg.start(d.records.output.run)
    await d.workers.pool.start_tasks(tg)
    # the fork server imports while we rendezvous
    d.workers.pool.warm_up(d.workers.group.preview())
    await tg.start(d.rendezvous.run)
    await tg.start(d.records.lag.run)
    await tg.start(d.records.events.retry_pending)
    await tg.start(d.workers.guardian.run)
    await tg.start(d.control.goodput.run)
    if d.workers.snapshots is not None:
        await tg.start(d.workers.snapshots.run)
    if d.watchers.watchdog is not None:
        path = await tg.start(d.watchers.watchdog.run)
        logger.info("deadline FIFO at %s", path)
    await tg.start(d.watchers.dstate.run)
    health_url = start_serving(tg, d)
    start_summaries(tg, d.rendezvous, d.control.view.hub, health_url)
    tg.start_soon(publish_status, d.control.view.hub, d.records.reporter)


def start_serving(tg: TaskGroup, daemon: Daemon) -> str | None:
    """The health endpoint (served once the first group is launched); its URL for peers."""
    settings, serving = daemon.settings, daemon.serving
    if serving is None:
        if not daemon.embedded:
            tg.start_soon(freeze_when_launched, daemon.controller.launched)
        return None
    port = serving.sock.getsockname()[1]
    announce(daemon.outside.runtime.path, local_url(settings.health_host, port),
             daemon.run_id)  # for the status command
    logger.info("health endpoint on http://%s:%d", settings.health_host, port)
    daemon.records.events.emit("health_listening", host=settings.health_host, port=port)
    tg.start_soon(serve_when_launched, tg, serving)
    return f"http://{advertised_host(settings, daemon.rendezvous)}:{port}"


# ------------------------------------------------------------------ shut down


async def wind_down(daemon: Daemon) -> None:
    """After the controller's last transition: the newest snapshot to disk, the last
    STATUS line, and the rendezvous told how this node ended."""
    snapshots = daemon.workers.snapshots
    if snapshots is not None:  # the workers are stopped: the newest step to disk
        await snapshots.finish(daemon.settings.shutdown_timeout)
    daemon.records.reporter.publish(daemon.control.view.hub.current)
    state = daemon.controller.state
    await _close_rendezvous(daemon.rendezvous, state)
    if state.phase is sm.Phase.QUARANTINED:  # a c10d host serves on
        await daemon.rendezvous.serve_until_job_ends()


async def close(outside: Outside, daemon: Daemon | None) -> None:
    """Close what was made, whether the run ended or its start failed half-way."""
    if outside.sock is not None:
        outside.sock.close()  # served or not: a start that failed later must not leak it
    if daemon is not None:
        daemon.outbox.close()  # an embedded run must leave no unclosed streams
        daemon.inbox.close()
    with anyio.CancelScope(shield=True):
        await outside.rendezvous.aclose()
    if daemon is not None:
        if daemon.workers.snapshots is not None:
            daemon.workers.snapshots.close()  # the regions: never left behind
        daemon.workers.guardian.close()
        daemon.watchers.owners.close()
        daemon.records.events.close()
        daemon.records.notifier.close()
    outside.runtime.cleanup()


def advertised_host(settings: Settings, rendezvous: Rendezvous) -> str:
    """The host others reach this node's health endpoint at: its ``--health-host``, else
    the address it joins etcd rounds with (peers take a health URL only on that address:
    ``decode.peer_health_url``)."""
    if settings.health_host not in ("0.0.0.0", "::", ""):
        return settings.health_host
    etcd = rendezvous.etcd_service()
    return settings.local_addr or (etcd.config.local_addr if etcd else "") or socket.gethostname()


def start_summaries(
    tg: TaskGroup, rendezvous: Rendezvous, hub: StatusHub, health_url: str | None
) -> None:
    """Publish this node's status summary in etcd (the job-wide view of ``status``), for
    every backend that keeps one: etcd, etcd-v2, and c10d in the etcd its host runs."""
    etcd = rendezvous.etcd_service()
    if etcd is not None and rendezvous.capabilities.job_status:
        from supervisor.rendezvous.etcd.summary import publish_summaries

        tg.start_soon(publish_summaries, etcd, hub, lambda: health_url)


async def _close_rendezvous(rendezvous: Rendezvous, state: sm.State) -> None:
    """A node that was asked to stop leaves alone; a job that failed here fails for all."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(10):
        try:
            if state.phase in (sm.Phase.STOPPED, sm.Phase.QUARANTINED):
                await rendezvous.leave()  # lease revoked: the others re-form at once
            elif state.phase is sm.Phase.FAILED and state.root_cause is not None and (
                state.root_cause.kind not in (sm.FailureKind.REMOTE, sm.FailureKind.RENDEZVOUS)
            ):
                await rendezvous.fail_job(state.last_decision_reason)
        except RendezvousError as exc:
            logger.warning("could not tell the rendezvous how this node ended: %s", exc)


async def publish_status(hub: StatusHub, reporter: StatusReporter) -> None:
    """Tell systemd each new state (STATUS=, READY=1 after the first launch)."""
    seen = -1
    while True:
        reporter.publish(hub.current)
        seen = hub.version
        await hub.wait_changed(seen)


async def deliver_signals(outbox: Outbox, *, task_status: TaskStatus[None]) -> None:
    """Turn signals into inbox items. Nothing else happens in a signal's context."""
    with anyio.open_signal_receiver(*STOP_SIGNALS, *FORWARD_SIGNALS, signal.SIGHUP) as signals:
        task_status.started()
        async for signum in signals:
            if signum in FORWARD_SIGNALS:
                outbox.send_nowait(ForwardSignal(signum))
            elif signum == signal.SIGHUP:
                outbox.send_nowait(ReopenLogs())
            else:
                outbox.send_nowait(sm.ShutdownRequested(signum))
