"""Start-up: the checks of what the outside world can refuse, then what is reached outside
this process (directories, the health socket, the rendezvous), for ``app.supervise``.

``check_start`` opens nothing; ``reach_outside`` leaves nothing behind when it fails.
Either failure is one line and exit 2 (``ConfigError``), or a clean exit 128+N when a stop
signal arrives while the rendezvous is being reached (``StoppedBeforeStart``).
"""

from __future__ import annotations

import logging
import shutil
import signal
import socket
import tempfile
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

import anyio
import msgspec
from anyio.abc import TaskStatus

from supervisor.config import ConfigError, Settings
from supervisor.controller import (
    CommandFor,
    CpusFor,
)
from supervisor.preflight import (
    check_devices,
    check_event_log,
    check_hang_dump,
    check_master_addr,
    check_node_check,
    check_run_dir,
    check_runnable,
    check_timer_file,
    forget_log_root,
    make_log_root,
    open_health_socket,
)
from supervisor.rendezvous.base import Rendezvous, RendezvousError
from supervisor.rendezvous.registry import (
    conf_barrier_timeout,
    make_rendezvous,
)
from supervisor.snapshots.persist import SnapshotDir
from supervisor.snapshots.service import open_snapshot_dir
from supervisor.watchdog.escalate import HangDump
from supervisor.workers.output import OutputPlan, OutputSpecError
from supervisor.workers.topology import cpus_for

logger = logging.getLogger("supervisor.app")  # its lines were always the composition root's

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)


def resolve_run_id(settings: Settings) -> str:
    if settings.standalone and settings.rdzv_id == "none":
        return uuid.uuid4().hex[:12]
    return settings.rdzv_id


class Plan(msgspec.Struct, frozen=True):
    """What the start-up checks settled, before anything is opened or joined."""

    settings: Settings
    hang_dump: HangDump
    cpus: CpusFor | None  # None: no binding
    output: OutputPlan
    run_id: str
    log_root: Path
    event_log: Path


def check_start(settings: Settings, environ: Mapping[str, str], *,
                command: CommandFor | None, cpus: CpusFor | None) -> Plan:
    """The checks of what the outside world can refuse that open nothing: one line and
    exit 2 each (``ConfigError``). Only the log root is made (``forget_log_root``)."""
    if command is None:
        check_runnable(settings, environ)
    check_node_check(settings, environ)
    check_devices(settings, environ)
    check_master_addr(settings)
    hang_dump = check_hang_dump(settings, environ)
    if cpus is None:
        cpus = cpus_for(settings)
    try:
        output = OutputPlan.from_settings(settings)
    except OutputSpecError as exc:
        raise ConfigError(str(exc)) from None
    run_id = resolve_run_id(settings)
    log_root = make_log_root(settings)
    event_log = Path(settings.event_log or log_root / run_id / "events.jsonl")
    return Plan(settings, hang_dump, cpus, output, run_id, log_root, event_log)


class Outside(msgspec.Struct, frozen=True):
    """What was opened or joined outside this process: closed by ``close``."""

    settings: Settings  # with the barrier timeout the backend's configuration gives
    runtime: RuntimeDir
    timer_file: Path | None
    snapshot_disk: SnapshotDir | None
    sock: socket.socket | None
    rendezvous: Rendezvous

    @property
    def timer_path(self) -> str | None:
        """The deadline FIFO's path as workers are told it (None: --no-watchdog)."""
        return str(self.timer_file) if self.timer_file else None


async def reach_outside(plan: Plan, environ: Mapping[str, str], *,
                        on_etcd_event: Callable[..., object], embedded: bool) -> Outside:
    """The run's directories, the health socket and the rendezvous: a refusal is one line
    and exit 2 (a stop signal meanwhile, ``StoppedBeforeStart``), and leaves nothing."""
    settings, log_root, run_id = plan.settings, plan.log_root, plan.run_id
    try:
        check_run_dir(log_root, run_id)
        check_event_log(plan.event_log, "event_log" if settings.event_log else "log_dir",
                        log_root)
        runtime = RuntimeDir.create(environ)  # before the rendezvous: a c10d host's etcd data
    except BaseException:
        forget_log_root(settings, log_root, run_id)
        raise
    timer_file = None if settings.no_watchdog else _timer_file(settings, runtime.path)
    sock: socket.socket | None = None
    rendezvous: Rendezvous | None = None
    try:
        if timer_file is not None:
            check_timer_file(timer_file)
        snapshot_disk = open_snapshot_dir(settings, run_id)  # owned by us, or exit 2
        # bound before anything joins a rendezvous: a busy or unusable port ends the start
        # here, with one line, instead of after this node was counted in by the others
        sock = None if settings.no_health else open_health_socket(settings)
        rendezvous = make_rendezvous(settings, run_id, runtime.path, on_event=on_etcd_event)
        settings = conf_barrier_timeout(settings, rendezvous)
        await connect_rendezvous(rendezvous, handle_signals=not embedded)
    except BaseException:
        if rendezvous is not None:
            with anyio.CancelScope(shield=True):
                await rendezvous.aclose()  # its HTTP session and a c10d host's etcd
        if sock is not None:
            sock.close()  # the Python API's caller lives on: leak nothing
        runtime.cleanup()
        forget_log_root(settings, log_root, run_id)
        raise
    return Outside(settings, runtime, timer_file, snapshot_disk, sock, rendezvous)


class StoppedBeforeStart(Exception):
    """A stop signal arrived while the rendezvous was being reached: exit 128+N."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


async def connect_rendezvous(rendezvous: Rendezvous, *, handle_signals: bool = False) -> None:
    """Reach the rendezvous (a c10d host starts its etcd here); failure is a ConfigError.
    This may wait until ``join_timeout`` for a service that is not up yet, so a stop
    signal meanwhile ends the run cleanly (``StoppedBeforeStart``)."""
    failure: RendezvousError | None = None
    received: list[int] = []
    async with anyio.create_task_group() as tg:
        if handle_signals:
            await tg.start(_cancel_on_stop_signal, tg.cancel_scope, received)
        try:
            await rendezvous.connect()
        except RendezvousError as exc:
            failure = exc
        tg.cancel_scope.cancel()
    if failure is None and not received:
        return
    with anyio.CancelScope(shield=True):
        await rendezvous.aclose()  # its HTTP session, or asyncio logs "Unclosed client session"
    if failure is not None:
        raise ConfigError(f"rdzv_endpoint: {failure}") from None
    logger.info("stopped by %s while reaching the rendezvous", signal.Signals(received[0]).name)
    raise StoppedBeforeStart(received[0])


async def _cancel_on_stop_signal(
    scope: anyio.CancelScope, received: list[int], *, task_status: TaskStatus[None]
) -> None:
    with anyio.open_signal_receiver(*STOP_SIGNALS) as signals:
        task_status.started()
        async for signum in signals:
            received.append(signum)
            scope.cancel()
            return


def _timer_file(settings: Settings, runtime_dir: Path) -> Path:
    if settings.timer_file:
        return Path(settings.timer_file)
    return runtime_dir / "watchdog" / "timer.fifo"


class RuntimeDir:
    """Private state (the FIFO): $RUNTIME_DIRECTORY under systemd, else a fresh 0700 dir."""

    def __init__(self, path: Path, owned: bool) -> None:
        self.path = path
        self.owned = owned

    @classmethod
    def create(cls, environ: Mapping[str, str]) -> RuntimeDir:
        given = environ.get("RUNTIME_DIRECTORY")
        if given:
            # systemd may pass several, space-separated; the first is ours
            return cls(Path(given.split()[0]), owned=False)
        return cls(Path(tempfile.mkdtemp(prefix="elastic-supervisor-run-")), owned=True)

    def cleanup(self) -> None:
        if self.owned:
            shutil.rmtree(self.path, ignore_errors=True)
