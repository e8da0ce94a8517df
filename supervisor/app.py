"""The composition root: one task group, every long-lived task started with ``tg.start``.

Order matters and is visible here: first the start-up checks of everything the outside
world can refuse (one line and exit 2 each; the health port is bound among them), then
signal handlers (before any worker exists), the watchdog (FIFO open) and the health
endpoint, then the controller, which launches the first group; systemd hears READY=1 only
after that.
"""

from __future__ import annotations

import errno
import faulthandler
import functools
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from anyio.abc import TaskGroup, TaskStatus

if TYPE_CHECKING:
    from supervisor.rendezvous.etcd import EtcdRendezvous

from supervisor.accounting import GoodputRecorder
from supervisor.config import (
    DEFAULT_HEALTH_PORT,
    ConfigError,
    Settings,
    advisories,
    healing_enabled,
    healing_limits,
    node_check_argv,
)
from supervisor.controller import (
    Attempt,
    CommandFor,
    Controller,
    CpusFor,
    ForwardSignal,
    Observer,
    Outbox,
    ReopenLogs,
    SnapshotHub,
)
from supervisor.core import state as sm
from supervisor.core.envs import default_omp_threads
from supervisor.core.snapshot import ProgressTable, Snapshot
from supervisor.events import EventLog
from supervisor.healing import Healing
from supervisor.health.looplag import LoopLag
from supervisor.logsetup import configure_logging
from supervisor.rendezvous.base import Rendezvous, RendezvousError
from supervisor.rendezvous.static import StaticRendezvous
from supervisor.systemd import (
    NOTIFY_ENV_VARS,
    Notifier,
    StatusReporter,
    extending_timeout,
    run_watchdog_pings,
)
from supervisor.watchdog.dstate import DStateMonitor
from supervisor.watchdog.escalate import HangDump, resolve_hang_dump
from supervisor.watchdog.fifo import FifoError, check_fifo_path
from supervisor.watchdog.timers import Watchdog, WatchdogConfig, owner_by_ancestry
from supervisor.workers.guardian import COOKIE_ENV, Guardian, set_child_subreaper
from supervisor.workers.nodecheck import NodeChecker
from supervisor.workers.output import OutputPlan, OutputSpecError
from supervisor.workers.topology import cpus_for

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
FORWARD_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def run_supervisor(settings: Settings, environ: Mapping[str, str] | None = None) -> int:
    """Run the daemon until the job ends; return the process exit code."""
    env = dict(os.environ if environ is None else environ)
    configure_logging(settings.log_level, settings.log_format)
    faulthandler.enable()  # a watchdog SIGABRT then leaves every thread's stack in the log
    try:
        return anyio.run(supervise, settings, env)
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


def _config_error(exc: BaseException) -> int:
    print(f"elastic-supervisor: config error: {exc}", file=sys.stderr)
    return 2


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def resolve_run_id(settings: Settings) -> str:
    if settings.standalone and settings.rdzv_id == "none":
        return uuid.uuid4().hex[:12]
    return settings.rdzv_id


def make_rendezvous(settings: Settings, run_id: str, runtime_dir: Path) -> Rendezvous:
    """The configured backend; bad endpoints or conf values are one-line ConfigErrors.
    ``etcd`` and ``etcd-v2`` both use our etcd v3 backend; ``c10d`` may host an etcd whose
    data lives in ``runtime_dir`` (``--standalone`` keeps torchrun's meaning: one node)."""
    backend = settings.rdzv_backend
    if backend == "static":
        return StaticRendezvous(
            run_id, settings.max_nodes, settings.node_rank, settings.master_addr,
            settings.master_port,
        )
    from supervisor.rendezvous.etcd import EtcdRendezvous, RendezvousConfigError, make_config

    if backend == "c10d":
        from supervisor.rendezvous.c10d import make_c10d_rendezvous

        try:
            return make_c10d_rendezvous(
                endpoint=settings.rdzv_endpoint, run_id=run_id, nnodes=settings.nnodes,
                rdzv_conf=settings.rdzv_conf, local_addr=settings.local_addr,
                runtime_dir=runtime_dir, standalone=settings.standalone,
                master_port=settings.master_port,
            )
        except RendezvousConfigError as exc:
            raise ConfigError(str(exc)) from None
    try:
        config = make_config(
            endpoint=settings.rdzv_endpoint, run_id=run_id, nnodes=settings.nnodes,
            rdzv_conf=settings.rdzv_conf, local_addr=settings.local_addr,
        )
    except RendezvousConfigError as exc:
        raise ConfigError(str(exc)) from None
    return EtcdRendezvous(config)


def conf_barrier_timeout(settings: Settings) -> Settings:
    """``--rdzv-conf exit_barrier_timeout=S`` (a documented etcd key) overrides the flag.
    Call after ``make_rendezvous``, which validated the conf."""
    if settings.rdzv_backend == "static":
        return settings
    pairs = (item.partition("=") for item in settings.rdzv_conf.split(","))
    value = {key.strip(): raw.strip() for key, _, raw in pairs}.get("exit_barrier_timeout")
    if value is None:
        return settings
    return msgspec.structs.replace(settings, exit_barrier_timeout=float(value))


def check_runnable(settings: Settings, environ: Mapping[str, str]) -> None:
    """Fail early with one line when the command cannot possibly start."""
    script = settings.training_script
    if settings.no_python and shutil.which(script, path=environ.get("PATH")) is None:
        raise ConfigError(f"training_script: command not found: {settings.training_script!r}")
    if not (settings.no_python or settings.module) and not os.path.exists(settings.training_script):
        raise ConfigError(f"training_script: no such file: {settings.training_script!r}")


def check_master_addr(settings: Settings) -> None:
    """The static backend hands ``master_addr`` to every worker as MASTER_ADDR: a name that
    does not resolve here is a start-up error; on one node, where the rank-0 worker hosts
    the store, an address of another machine is almost surely a mistake (a warning)."""
    if settings.rdzv_backend != "static":
        return
    addr = settings.master_addr
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise ConfigError(f"master_addr: cannot resolve {addr!r}: {reason}") from None
    if settings.max_nodes > 1:
        return
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((sockaddr[0], 0))
        except OSError:
            logger.warning("master_addr: %s is not an address of this machine; on one node "
                           "the rank-0 worker hosts the store here, so workers may not reach "
                           "it (the default is 127.0.0.1)", addr)


def check_node_check(settings: Settings, environ: Mapping[str, str]) -> None:
    """``--node-check``'s program exists and may be run (else exit 2, one line)."""
    argv = node_check_argv(settings)
    if argv and shutil.which(argv[0], path=environ.get("PATH")) is None:
        raise ConfigError(f"node_check: command not found or not executable: {argv[0]!r}")


def make_healing(settings: Settings, rendezvous: Rendezvous, events: EventLog,
                 base_env: Mapping[str, str], run_id: str, log_root: Path, *,
                 changed: Callable[[], None]) -> Healing:
    """Root causes always; node checks and quarantine when asked for (``healing_enabled``).
    The check gets the rank-independent part of the workers' environment."""
    limits = healing_limits(settings)
    ledger = rendezvous.node_ledger(limits)
    checker = None
    if healing_enabled(settings):
        env = {**base_env, "TORCHELASTIC_RUN_ID": run_id, "ELASTIC_SUPERVISOR_RUN_ID": run_id,
               "ELASTIC_SUPERVISOR_NODE_ID": ledger.node, "ROLE_NAME": settings.role,
               "LOCAL_WORLD_SIZE": str(settings.local_world_size),
               "TORCHELASTIC_MAX_RESTARTS": str(settings.max_restarts)}
        checker = NodeChecker(node_check_argv(settings), env, settings.node_check_timeout,
                              log_root)
    return Healing(limits, ledger, checker, events, interval=settings.node_check_interval,
                   retry=settings.node_check_retry, changed=changed)


def check_devices(settings: Settings, environ: Mapping[str, str]) -> None:
    """Virtual local rank hands each worker one entry of CUDA_VISIBLE_DEVICES: enough?"""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if not settings.virtual_local_rank or visible is None:
        return
    devices = [d for d in visible.split(",") if d.strip()]
    if len(devices) < settings.local_world_size:
        raise ConfigError(
            f"virtual_local_rank: {settings.local_world_size} workers per node but "
            f"CUDA_VISIBLE_DEVICES={visible!r} lists {len(devices)} device(s)"
        )


def check_hang_dump(settings: Settings, environ: Mapping[str, str]) -> HangDump:
    """``--hang-dump``, with py-spy found and able to attach, or a one-line ConfigError."""
    if settings.no_watchdog:
        return HangDump()
    try:
        spec = resolve_hang_dump(settings.hang_dump, environ)
    except ValueError as exc:
        raise ConfigError(f"hang_dump: {exc}") from None
    if spec.mode == "py-spy":
        logger.info("hang dumps by %s", spec.py_spy)
    return spec


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
    process, so it installs no signal handlers, does not become a child subreaper (the
    host's other children are not ours to sweep) and does not talk to systemd.
    ``command`` and ``cpus`` override how each rank's command line and CPU binding are made.
    """
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
    log_root = _log_root(settings)
    event_log = Path(settings.event_log or log_root / run_id / "events.jsonl")
    check_event_log(event_log, "event_log" if settings.event_log else "log_dir")
    runtime = RuntimeDir.create(environ)  # before the rendezvous: a c10d host's etcd data
    timer_file = None if settings.no_watchdog else _timer_file(settings, runtime.path)
    sock: socket.socket | None = None
    rendezvous: Rendezvous | None = None
    try:
        if timer_file is not None:
            try:
                check_fifo_path(timer_file)
            except FifoError as exc:
                raise ConfigError(f"timer_file: {exc}") from None
        # bound before anything joins a rendezvous: a busy or unusable port ends the start
        # here, with one line, instead of after this node was counted in by the others
        sock = None if settings.no_health else open_health_socket(settings)
        rendezvous = make_rendezvous(settings, run_id, runtime.path)
        settings = conf_barrier_timeout(settings)
        await connect_rendezvous(rendezvous, handle_signals=not embedded)
    except BaseException:
        if rendezvous is not None:
            with anyio.CancelScope(shield=True):
                await rendezvous.aclose()  # its HTTP session and a c10d host's etcd
        if sock is not None:
            sock.close()  # the Python API's caller lives on: leak nothing
        runtime.cleanup()
        raise
    events = EventLog(event_log, run_id)
    etcd = etcd_rendezvous_of(rendezvous)
    if etcd is not None:  # outages, their end and replaced leases, in the event log
        etcd.on_event = events.emit
    notifier = Notifier(None) if embedded else Notifier.from_environ(environ)
    reporter = StatusReporter(notifier)
    lag = LoopLag()
    lag.add_listener(lambda stall: events.emit("loop_stall", **stall.fields()))
    output.loss.listeners.append(lambda name, fields: events.emit(name, **fields))
    progress = ProgressTable()
    if not embedded:
        set_child_subreaper()
    cookie = uuid.uuid4().hex
    # the guardian also removes the runtime directory if we die (a SIGKILL skips cleanup)
    guardian = Guardian(cookie, runtime_dir=runtime.path if runtime.owned else None)
    hub = SnapshotHub(_initial_snapshot(settings, run_id))
    goodput = GoodputRecorder(
        events, progress, started=time.monotonic(), bound=settings.progress_timeout
    )
    # a rank's first output line is progress when it posts no deadlines (ProgressTable)
    output.on_first_line = lambda local_rank: progress.touch_output(local_rank, time.monotonic())
    observers: list[Observer] = [_StopNotice(reporter), goodput]
    base_env = worker_base_env(environ, settings.local_world_size, cookie)
    healing = make_healing(settings, rendezvous, events, base_env, run_id, log_root,
                           changed=lambda: hub.publish(controller.snapshot()))
    controller = Controller(
        settings, rendezvous, run_id=run_id, events=events, hub=hub, log_root=log_root,
        output=output, environ=base_env,
        timer_file=str(timer_file) if timer_file else None, guardian=guardian,
        exempt_pids=[guardian.pid, *rendezvous_children(rendezvous)],
        sweep_adopted=not embedded, command=command, cpus=cpus,
        progress=progress, observers=observers,
        stop_guard=lambda: extending_timeout(notifier), goodput=goodput, healing=healing,
    )
    goodput.republish = lambda: hub.publish(controller.snapshot())
    if etcd is not None:  # an outage's start and end change /status: publish them
        controller.service_status = etcd.outage_status
        emit = events.emit

        def on_etcd_event(kind: str, **fields: Any) -> None:
            emit(kind, **fields)
            hub.publish(controller.snapshot())

        etcd.on_event = on_etcd_event
    goodput.shown = controller.shown_attempt
    for level, note in advisories(settings):  # after the checks: a failed start is one line
        logger.log(level, "%s", note)
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
            await tg.start(run_watchdog_pings, notifier)
            await tg.start(output.run)
            await tg.start(rendezvous.run)
            await tg.start(lag.run)
            await tg.start(events.retry_pending)
            await tg.start(guardian.run)
            await tg.start(goodput.run)
            watchdog = None
            health_url: str | None = None
            if timer_file is not None:
                watchdog = await start_watchdog(
                    tg, settings, controller, timer_file, send, hang_dump
                )
            if sock is not None:
                port = sock.getsockname()[1]
                controller.health_port = port  # in the STATUS line and /status
                logger.info("health endpoint on http://%s:%d", settings.health_host, port)
                events.emit("health_listening", host=settings.health_host, port=port)
                tg.start_soon(serve_when_launched, tg, controller, sock, lag, watchdog)
                health_url = f"http://{advertised_host(settings)}:{port}"
            if settings.rdzv_backend == "etcd":
                start_summaries(tg, rendezvous, hub, health_url)
            tg.start_soon(publish_status, hub, reporter)
            code = await controller.run(receive, send)
            reporter.publish(hub.current)
            await _close_rendezvous(rendezvous, controller.state)
            if controller.state.phase is sm.Phase.QUARANTINED:  # a c10d host serves on
                await rendezvous.serve_until_job_ends()
            tg.cancel_scope.cancel()
    finally:
        if sock is not None:
            sock.close()  # served or not: a start that failed later must not leak it
        send.close()  # an embedded run must leave no unclosed streams (ResourceWarning)
        receive.close()
        with anyio.CancelScope(shield=True):
            await rendezvous.aclose()
        guardian.close()
        events.close()
        notifier.close()
        runtime.cleanup()
    return code


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


def etcd_rendezvous_of(rendezvous: Rendezvous) -> EtcdRendezvous | None:
    """The etcd rendezvous behind the backend (c10d wraps one), if there is one."""
    if "supervisor.rendezvous.etcd" not in sys.modules:
        return None  # the static backend: nothing of etcd was ever imported
    from supervisor.rendezvous.etcd import EtcdRendezvous

    inner = getattr(rendezvous, "inner", rendezvous)
    return inner if isinstance(inner, EtcdRendezvous) else None


def rendezvous_children(rendezvous: Rendezvous) -> list[int]:
    """Our children that belong to the rendezvous (a c10d host's etcd): never swept as
    strays when a worker group stops."""
    pid = getattr(rendezvous, "server_pid", None)
    return [pid] if isinstance(pid, int) else []


def advertised_host(settings: Settings) -> str:
    """The host others reach this node's health endpoint at."""
    if settings.health_host not in ("0.0.0.0", "::", ""):
        return settings.health_host
    return settings.local_addr or socket.gethostname()


def start_summaries(
    tg: TaskGroup, rendezvous: Rendezvous, hub: SnapshotHub, health_url: str | None
) -> None:
    """Publish this node's status summary in etcd (the job-wide view of ``status``);
    for c10d too, in the etcd its host runs."""
    etcd = etcd_rendezvous_of(rendezvous)
    if etcd is not None:
        from supervisor.rendezvous.summary import publish_summaries

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


def _timer_file(settings: Settings, runtime_dir: Path) -> Path:
    if settings.timer_file:
        return Path(settings.timer_file)
    return runtime_dir / "watchdog" / "timer.fifo"


def open_health_socket(settings: Settings) -> socket.socket:
    """The health endpoint's listening socket. A port that came from no flag, file or
    variable (the built-in default) moves to a free one when busy, with a warning: two
    jobs with default settings on one workstation both start. A chosen port never moves."""
    host, port = settings.health_host, settings.health_port
    if port is not None:
        return bind_health_socket(host, port)
    try:
        return bind_health_socket(host, DEFAULT_HEALTH_PORT)
    except PortBusy:
        sock = bind_health_socket(host, 0)
        logger.warning(
            "health_port: the default port %d is busy (another supervisor?); listening on "
            "free port %d instead (set --health-port to choose one)",
            DEFAULT_HEALTH_PORT, sock.getsockname()[1],
        )
        return sock


class PortBusy(ConfigError):
    """The port is in use by another socket."""


def bind_health_socket(host: str, port: int) -> socket.socket:
    """Bind and listen now (port 0 picks one): probes queue in the backlog until served.
    Every failure is a one-line ConfigError naming the setting at fault."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise _bind_error(host, port, exc) from None
    sock.setblocking(False)
    return sock


def _bind_error(host: str, port: int, exc: OSError) -> ConfigError:
    where = f"{host}:{port}"
    if isinstance(exc, socket.gaierror):
        return ConfigError(f"health_host: cannot resolve {host!r}: {exc.strerror}")
    if exc.errno == errno.EADDRNOTAVAIL:
        return ConfigError(f"health_host: {host} is not an address of this machine ({where})")
    if exc.errno == errno.EADDRINUSE:
        return PortBusy(f"health_port: cannot listen on {where}: port already in use "
                        "(another supervisor? choose another --health-port, or 0 for any)")
    if exc.errno == errno.EACCES:
        return ConfigError(f"health_port: cannot listen on {where}: permission denied "
                           "(ports below 1024 need root or CAP_NET_BIND_SERVICE)")
    return ConfigError(f"health_port: cannot listen on {where}: {exc.strerror or exc}")


SERVE_DEFER = 0.5  # seconds the health server may wait for the first launch before serving


async def serve_when_launched(
    tg: TaskGroup,
    controller: Controller,
    sock: socket.socket,
    lag: LoopLag,
    watchdog: Watchdog | None,
) -> None:
    """Serve HTTP once the first group is launched (or SERVE_DEFER passed, for a long
    rendezvous): importing aiohttp and prometheus-client costs ~100 ms, which would
    otherwise delay every worker's start. The socket is already bound and listening."""
    with anyio.move_on_after(SERVE_DEFER):
        await controller.launched.wait()
    import psutil  # noqa: F401  -- the D-state sampler's: now, not in its first (idle) sample

    from supervisor.health.metrics import Metrics
    from supervisor.health.server import serve_health

    metrics = Metrics(started=controller.started)
    controller.attach_late(metrics)
    etcd = etcd_rendezvous_of(controller.rendezvous)
    if etcd is not None:
        from supervisor.rendezvous.etcd_metrics import EtcdCollector

        metrics.registry.register(EtcdCollector(etcd))
    if controller.healing is not None:
        from supervisor.health.healing_metrics import HealingCollector

        metrics.registry.register(HealingCollector(controller.healing))
    metrics.watch_loop(lag)
    metrics.watch_event_log(controller.events)
    metrics.watch_output(controller.output.loss)
    if controller.goodput is not None:
        controller.goodput.attach_metrics(metrics)
    if watchdog is not None:
        watchdog.metrics = metrics
    serve = functools.partial(serve_health, sock=sock)
    await tg.start(
        serve, "", 0, lambda: controller.hub.current, controller.progress, metrics, lag.current
    )


async def start_watchdog(
    tg: TaskGroup,
    settings: Settings,
    controller: Controller,
    timer_file: Path,
    outbox: Outbox,
    hang_dump: HangDump,
) -> Watchdog:
    """Open the deadline FIFO and start the D-state check; both report into the inbox."""

    def dump_path(local_rank: int, pid: int) -> Path | None:
        attempt = controller.attempt
        return attempt.directory / str(local_rank) / f"hang-{pid}.txt" if attempt else None

    config = WatchdogConfig(
        kill_grace=min(5.0, max(0.5, settings.shutdown_timeout)),
        hang_dump=hang_dump,
        dump_path=dump_path,
    )
    watchdog = Watchdog(
        timer_file,
        owner=lambda pid: owner_by_ancestry(pid, controller.live_worker_ranks()),
        progress=controller.progress,
        on_expired=outbox.send,
        config=config,
    )
    path = await tg.start(watchdog.run)
    dstate = DStateMonitor(
        controller.live_worker_ranks, outbox.send, hang_state_timeout=settings.hang_state_timeout
    )
    await tg.start(dstate.run)
    controller.observers.append(_WatchdogHooks(watchdog, dstate))
    logger.info("deadline FIFO at %s", path)
    return watchdog


class _WatchdogHooks:
    """Keeps the watchdog's tables in step with the worker group."""

    def __init__(self, watchdog: Watchdog, dstate: DStateMonitor) -> None:
        self.watchdog = watchdog
        self.dstate = dstate

    def on_transition(
        self, old: sm.State, new: sm.State, event: sm.Event, decision: sm.Decision
    ) -> None:
        if isinstance(event, sm.WorkerExited):
            self.watchdog.forget_pid(event.pid)

    def on_launch(self, attempt: Attempt) -> None:
        # before any worker of the attempt can post: they are still exec'ing
        self.watchdog.reset(attempt.number)
        self.dstate.reset(attempt.number)

    def on_stopped(self, attempt: Attempt) -> None:
        self.watchdog.clear()


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


def worker_base_env(
    environ: Mapping[str, str], local_world_size: int, cookie: str | None = None
) -> dict[str, str]:
    """The environment workers start from: ours, minus systemd's notify variables (a worker
    must never be able to ping our watchdog or send READY=1 for us), plus the guardian's
    cookie, which marks every descendant as ours."""
    env = {k: v for k, v in environ.items() if k not in NOTIFY_ENV_VARS}
    if cookie is not None:
        env[COOKIE_ENV] = cookie
    return default_omp_threads(env, local_world_size)


async def publish_status(hub: SnapshotHub, reporter: StatusReporter) -> None:
    """Tell systemd each new state (STATUS=, READY=1 after the first launch)."""
    seen = -1
    while True:
        reporter.publish(hub.current)
        seen = hub.version
        await hub.wait_changed(seen)


class _StopNotice:
    """Sends STOPPING=1 the moment a shutdown stop begins (before workers get SIGTERM)."""

    def __init__(self, reporter: StatusReporter) -> None:
        self.reporter = reporter

    def on_transition(
        self, old: sm.State, new: sm.State, event: sm.Event, decision: sm.Decision
    ) -> None:
        if isinstance(decision, sm.StopGroup) and decision.reason is sm.StopReason.SHUTDOWN:
            self.reporter.stopping(f"stopping: {sm.signal_name(decision.signum)} received")

    def on_launch(self, attempt: Attempt) -> None:
        return None

    def on_stopped(self, attempt: Attempt) -> None:
        return None


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
    """The log directory, created and writable, or a one-line ConfigError."""
    if settings.log_dir:
        root = Path(settings.log_dir)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"log_dir: cannot create {root}: {_reason(exc)}") from None
        if not os.access(root, os.W_OK | os.X_OK):
            raise ConfigError(f"log_dir: {root} is not writable by this user")
        return root
    # like torchrun: a fresh directory that outlives the run, so error files stay readable
    try:
        return Path(tempfile.mkdtemp(prefix="elastic-supervisor-"))
    except OSError as exc:
        message = f"log_dir: cannot create a directory in {tempfile.gettempdir()}: {_reason(exc)}"
        raise ConfigError(message + " (set --log-dir or TMPDIR)") from None


def check_event_log(path: Path, setting: str) -> None:
    """Open the event log for append once, now: an unusable path stops the start with one
    line (later write errors are logged and the job goes on)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot open the event log {path}: {_reason(exc)}") from None
    os.close(fd)


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _initial_snapshot(settings: Settings, run_id: str) -> Snapshot:
    return Snapshot(
        run_id=run_id, phase=sm.Phase.RENDEZVOUS.value, attempt=0, restart_count=0,
        max_restarts=settings.max_restarts, restarts_left=settings.max_restarts, world_size=0,
        local_world_size=settings.local_world_size, role=settings.role,
        published_at=time.monotonic(), started_at_wall=time.time(),
        progress_timeout=settings.progress_timeout, ready_when=settings.ready_when,
    )
