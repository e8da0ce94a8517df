"""The composition root: one task group, every long-lived task started with ``tg.start``.

Order matters and is visible here: signal handlers first (before any worker exists), then
the health endpoint (port bound) and the watchdog (FIFO open), then the controller, which
launches the first group; systemd hears READY=1 only after that.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path

import anyio
from anyio.abc import TaskStatus

from supervisor.config import ConfigError, Settings
from supervisor.controller import (
    CommandFor,
    Controller,
    CpusFor,
    ForwardSignal,
    Outbox,
    ReopenLogs,
    SnapshotHub,
)
from supervisor.core import state as sm
from supervisor.core.envs import default_omp_threads
from supervisor.core.snapshot import Snapshot
from supervisor.events import EventLog
from supervisor.rendezvous.base import Rendezvous
from supervisor.rendezvous.static import StaticRendezvous
from supervisor.workers.guardian import Guardian, set_child_subreaper
from supervisor.workers.output import OutputPlan, OutputSpecError

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
FORWARD_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def run_supervisor(settings: Settings, environ: Mapping[str, str] | None = None) -> int:
    """Run the daemon until the job ends; return the process exit code."""
    env = dict(os.environ if environ is None else environ)
    _configure_logging(settings)
    try:
        return anyio.run(supervise, settings, env)
    except ConfigError as exc:
        print(f"elastic-supervisor: config error: {exc}", file=sys.stderr)
        return 2


def _configure_logging(settings: Settings) -> None:
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s elastic-supervisor[%(process)d] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def resolve_run_id(settings: Settings) -> str:
    if settings.standalone and settings.rdzv_id == "none":
        return uuid.uuid4().hex[:12]
    return settings.rdzv_id


def make_rendezvous(settings: Settings, run_id: str) -> Rendezvous:
    if settings.rdzv_backend == "static":
        return StaticRendezvous(
            run_id, settings.max_nodes, settings.node_rank, settings.master_addr,
            settings.master_port,
        )
    raise ConfigError(f"rdzv_backend: {settings.rdzv_backend!r} is not available")


def check_runnable(settings: Settings, environ: Mapping[str, str]) -> None:
    """Fail early with one line when the command cannot possibly start."""
    script = settings.training_script
    if settings.no_python and shutil.which(script, path=environ.get("PATH")) is None:
        raise ConfigError(f"training_script: command not found: {settings.training_script!r}")
    if not (settings.no_python or settings.module) and not os.path.exists(settings.training_script):
        raise ConfigError(f"training_script: no such file: {settings.training_script!r}")


async def supervise(
    settings: Settings,
    environ: dict[str, str],
    *,
    command: CommandFor | None = None,
    cpus: CpusFor | None = None,
    embedded: bool = False,
) -> int:
    """Compose and run every task; returns the exit code.

    ``embedded`` is the Python API's mode: the supervisor runs inside someone else's
    process, so it installs no signal handlers and does not become a child subreaper
    (the host's other children are not ours to sweep). ``command`` and ``cpus`` override
    how each rank's command line and CPU binding are made.
    """
    if command is None:
        check_runnable(settings, environ)
    try:
        output = OutputPlan(settings.redirects, settings.tee, settings.local_world_size)
    except OutputSpecError as exc:
        raise ConfigError(str(exc)) from None
    run_id = resolve_run_id(settings)
    log_root = _log_root(settings)
    events = EventLog(settings.event_log or log_root / run_id / "events.jsonl", run_id)
    rendezvous = make_rendezvous(settings, run_id)
    if not embedded:
        set_child_subreaper()
    guardian = Guardian()
    hub = SnapshotHub(_initial_snapshot(settings, run_id))
    controller = Controller(
        settings, rendezvous, run_id=run_id, events=events, hub=hub, log_root=log_root,
        output=output, environ=default_omp_threads(environ, settings.local_world_size),
        timer_file=None, guardian=guardian, exempt_pids=[guardian.pid],
        sweep_adopted=not embedded, command=command, cpus=cpus,
    )
    events.emit("supervisor_started", pid=os.getpid(), log_dir=str(log_root),
                local_world_size=settings.local_world_size, backend=settings.rdzv_backend)
    logger.info("run %s: logs under %s", run_id, log_root / run_id)
    send, receive = anyio.create_memory_object_stream[sm.Event | ForwardSignal | ReopenLogs](
        max_buffer_size=4096
    )
    try:
        async with anyio.create_task_group() as tg:
            if not embedded:
                await tg.start(deliver_signals, send)
            code = await controller.run(receive, send)
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await rendezvous.aclose()
        guardian.close()
        events.close()
    return code


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


def _log_root(settings: Settings) -> Path:
    if settings.log_dir:
        root = Path(settings.log_dir)
        root.mkdir(parents=True, exist_ok=True)
        return root
    # like torchrun: a fresh directory that outlives the run, so error files stay readable
    return Path(tempfile.mkdtemp(prefix="elastic-supervisor-"))


def _initial_snapshot(settings: Settings, run_id: str) -> Snapshot:
    import time

    return Snapshot(
        run_id=run_id, phase=sm.Phase.RENDEZVOUS.value, attempt=0, restart_count=0,
        max_restarts=settings.max_restarts, restarts_left=settings.max_restarts, world_size=0,
        local_world_size=settings.local_world_size, role=settings.role,
        published_at=time.monotonic(), started_at_wall=time.time(),
        progress_timeout=settings.progress_timeout,
    )
