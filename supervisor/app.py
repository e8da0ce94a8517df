"""The composition root: one task group, every long-lived task started with ``tg.start``.

Order matters and is visible here: first the start-up checks of everything the outside
world can refuse (one line and exit 2 each; the health port is bound among them), then
signal handlers (before any worker exists), the watchdog (FIFO open) and the health
endpoint, then the controller, which launches the first group; systemd hears READY=1 only
after that.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import msgspec
from anyio.abc import TaskGroup, TaskStatus

from supervisor.accounting import GoodputRecorder
from supervisor.config import ConfigError, Settings, advisories
from supervisor.controller import (
    Attempt,
    CommandFor,
    Controller,
    CpusFor,
    ForwardSignal,
    Inbox,
    InboxItem,
    Observer,
    Outbox,
    ReopenLogs,
    StatusHub,
    restart_policy,
)
from supervisor.core import state as sm
from supervisor.core.envs import default_omp_threads, interpreter, standby_python
from supervisor.core.slots import Restore
from supervisor.core.statusview import ProgressTable
from supervisor.core.warm import attempt_may_follow
from supervisor.discovery import announce, local_url
from supervisor.events import EventLog
from supervisor.healing import make_healing
from supervisor.health.looplag import LoopLag
from supervisor.logsetup import configure_logging
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
from supervisor.priority import describe as describe_priority
from supervisor.priority import raise_loop_priority
from supervisor.rendezvous.base import Rendezvous, RendezvousError
from supervisor.rendezvous.etcd.persist_mark import PersistMarks
from supervisor.rendezvous.registry import (
    backend_advisories,
    conf_barrier_timeout,
    make_rendezvous,
)
from supervisor.serving import Serving, freeze_when_launched, serve_when_launched
from supervisor.snapshot import ENV_VAR as SNAPSHOT_ENV
from supervisor.snapshots.channel import Sender
from supervisor.snapshots.persist import SnapshotDir
from supervisor.snapshots.service import SnapshotService, build_snapshots, open_snapshot_dir
from supervisor.systemd import (
    NOTIFY_ENV_VARS,
    Notifier,
    StatusReporter,
    extending_timeout,
    run_watchdog_pings,
)
from supervisor.views import ReadModel, RunResult
from supervisor.watchdog.dstate import DStateMonitor
from supervisor.watchdog.escalate import HangDump
from supervisor.watchdog.owners import OwnerCache, owner_by_ancestry
from supervisor.watchdog.timers import Watchdog, WatchdogConfig
from supervisor.workers.group import WorkerGroup
from supervisor.workers.guardian import COOKIE_ENV, Guardian, set_child_subreaper
from supervisor.workers.nodecheck import CheckLauncher
from supervisor.workers.output import OutputPlan, OutputSpecError
from supervisor.workers.spawn import SPAWNER, DeathSignal
from supervisor.workers.topology import cpus_for
from supervisor.workers.warm.base import NullPool, Pool

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
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


def resolve_run_id(settings: Settings) -> str:
    if settings.standalone and settings.rdzv_id == "none":
        return uuid.uuid4().hex[:12]
    return settings.rdzv_id



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
    outside = await reach_outside(plan, environ, hooks, embedded=embedded)
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


class Hooks:
    """The two reports that reach parts made after their sender: the rendezvous (made
    before the event log, as it must connect first) reports etcd outages, and goodput,
    healing and the snapshot service (made before the read model that shows them) say
    that what it shows changed. ``connect`` is called once both exist, before any task
    runs, which is the first that can report."""

    def __init__(self) -> None:
        self._events: EventLog | None = None
        self._view: ReadModel | None = None

    def connect(self, events: EventLog, view: ReadModel) -> None:
        self._events, self._view = events, view

    def etcd_event(self, kind: str, **fields: Any) -> None:
        """An etcd outage, its end, a replaced lease: logged and shown in /status."""
        assert self._events is not None
        self._events.emit(kind, **fields)
        self.changed()

    def changed(self) -> None:
        """What the read model shows changed outside a transition: publish it again."""
        assert self._view is not None
        self._view.publish()


class Outside(msgspec.Struct, frozen=True):
    """What was opened or joined outside this process: closed by ``close``."""

    settings: Settings  # with the barrier timeout the backend's configuration gives
    runtime: RuntimeDir
    timer_file: Path | None
    snapshot_disk: SnapshotDir | None
    sock: socket.socket | None
    rendezvous: Rendezvous


async def reach_outside(plan: Plan, environ: Mapping[str, str], hooks: Hooks, *,
                        embedded: bool) -> Outside:
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
        rendezvous = make_rendezvous(settings, run_id, runtime.path, on_event=hooks.etcd_event)
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


class Daemon(msgspec.Struct, frozen=True):
    """Every part of the running supervisor, made by ``wire``."""

    settings: Settings
    run_id: str
    log_root: Path
    embedded: bool
    outside: Outside
    events: EventLog
    notifier: Notifier
    reporter: StatusReporter
    lag: LoopLag
    output: OutputPlan
    progress: ProgressTable
    snapshots: SnapshotService | None
    guardian: Guardian
    pool: Pool
    group: WorkerGroup
    goodput: GoodputRecorder
    view: ReadModel
    controller: Controller
    owners: OwnerCache
    watchdog: Watchdog | None
    dstate: DStateMonitor
    serving: Serving | None
    inbox: Inbox
    outbox: Outbox

    @property
    def rendezvous(self) -> Rendezvous:
        return self.outside.rendezvous


def wire(plan: Plan, outside: Outside, environ: Mapping[str, str], hooks: Hooks, *,
         command: CommandFor | None, embedded: bool) -> Daemon:
    """Make every part, each handed what it uses; nothing runs yet."""
    settings, run_id, output = outside.settings, plan.run_id, plan.output
    rendezvous = outside.rendezvous
    events = EventLog(plan.event_log, run_id, root=plan.log_root)
    notifier = Notifier(None) if embedded else Notifier.from_environ(environ)
    lag = LoopLag()
    lag.add_listener(lambda stall: events.emit("loop_stall", **stall.fields()))
    output.loss.listeners.append(lambda name, fields: events.emit(name, **fields))
    progress = ProgressTable()
    # a line matching --progress-pattern is progress when a rank posts no deadlines
    output.on_progress_line = lambda local_rank: progress.touch_output(local_rank,
                                                                       time.monotonic())
    if not embedded:
        set_child_subreaper()
    outbox, inbox = anyio.create_memory_object_stream[InboxItem](max_buffer_size=4096)
    group: WorkerGroup  # made below; the snapshot socket asks it who a pid is
    goodput: GoodputRecorder  # made below; a restore is a goodput phase
    controller: Controller  # made below; the restore step is agreed by its round's nodes

    def restored(restore: Restore | None) -> None:
        if restore is not None:
            events.emit("snapshot_restored", step=restore.step, source=restore.source,
                        newest=restore.newest, replicated=restore.replicated)
            goodput.on_restored(restore.step, restore.newest, restore.saved_at,
                                restore.source)

    snapshots = build_snapshots(
        settings, coordinates_nodes=rendezvous.capabilities.coordinates_nodes,
        runtime_dir=outside.runtime.path, progress=progress,
        identify=lambda pid: identify_worker(group, pid), changed=hooks.changed,
        on_restore=restored, placement=lambda: controller.round, disk=outside.snapshot_disk)
    etcd = rendezvous.etcd_service()
    if snapshots is not None and etcd is not None:  # told when this node joins a round
        etcd.snapshot_report = snapshots.report
        snapshots.marks = PersistMarks(etcd)  # the steps every node persists
    cookie = uuid.uuid4().hex
    guardian = make_guardian(cookie, outside.runtime, snapshots)
    death = DeathSignal()
    pool = make_pool(settings, rendezvous, environ, death, progress, guardian,
                     fork_server=not embedded, run_dir=plan.log_root / run_id)
    base_env = worker_base_env(environ, settings.local_world_size, cookie)
    if snapshots is not None:  # the only variable of ours a worker gets
        base_env[SNAPSHOT_ENV] = str(snapshots.socket_path)
    timer_file = str(outside.timer_file) if outside.timer_file else None
    group = WorkerGroup(
        settings, run_id=run_id, events=events, log_root=plan.log_root, output=output,
        environ=base_env, timer_file=timer_file, post=outbox.send_nowait,
        death=death, pool=pool, guardian=guardian,
        exempt_pids=[guardian.pid, *rendezvous.extra_pids()],
        sweep_adopted=not embedded, command=command, cpus=plan.cpus,
    )
    policy = restart_policy(settings)
    healing = make_healing(settings, rendezvous, events, base_env, run_id, plan.log_root,
                           launcher=CheckLauncher(death, guardian), changed=hooks.changed)
    goodput = GoodputRecorder(
        events, progress, started=time.monotonic(), bound=settings.progress_timeout,
        republish=hooks.changed, shown=group.shown_attempt,
    )
    sock = outside.sock
    view = ReadModel(
        settings, run_id=run_id, backend=rendezvous.backend, group=group, policy=policy,
        events=events, output=output, timer_file=timer_file,
        health_port=sock.getsockname()[1] if sock is not None else None, goodput=goodput,
        service_status=etcd.outage_status if etcd is not None else None,
        members_checked=rendezvous.capabilities.coordinates_nodes or settings.max_nodes == 1,
        node_health=healing,
        snapshots=snapshots.status if snapshots is not None else None,
    )
    hooks.connect(events, view)
    reporter = StatusReporter(notifier)
    observers: list[Observer] = [_StopNotice(reporter), goodput]
    if snapshots is not None:  # before the launch it observes: the restore step first
        observers.insert(0, snapshots)
    controller = Controller(
        settings, rendezvous, group=group, view=view, policy=policy, events=events,
        output=output, progress=progress, observers=observers,
        stop_guard=lambda: extending_timeout(notifier), healing=healing,
        late_observer=sock is not None,  # the metrics, attached by serve_when_launched
    )
    owners = OwnerCache(controller.live_worker_ranks)  # whose deadline requests are whose
    watchdog = None if outside.timer_file is None else make_watchdog(
        settings, outside.timer_file, plan.hang_dump, owners, progress, group, outbox)
    # health signals run whether or not the deadline FIFO does (--no-watchdog)
    dstate = DStateMonitor(controller.live_worker_ranks, outbox.send,
                           hang_state_timeout=settings.hang_state_timeout)
    controller.attach(_WatchdogHooks(watchdog, dstate))
    serving = None if sock is None else Serving(
        sock=sock, launched=controller.launched, started=controller.started,
        attach=controller.attach_late, hub=view.hub, progress=progress, lag=lag,
        watchdog=watchdog, goodput=goodput, events=events, output=output, pool=pool,
        etcd=etcd, healing=healing, snapshots=snapshots, freeze=not embedded)
    return Daemon(settings, run_id, plan.log_root, embedded, outside, events, notifier,
                  reporter, lag, output, progress, snapshots, guardian, pool, group, goodput,
                  view, controller, owners, watchdog, dstate, serving, inbox, outbox)


def make_guardian(cookie: str, runtime: RuntimeDir, snapshots: SnapshotService | None
                  ) -> Guardian:
    """The guardian also removes the runtime directory and the snapshot regions if we die
    (a SIGKILL skips every cleanup)."""
    return Guardian(cookie, runtime_dir=runtime.path if runtime.owned else None,
                    also_remove=[snapshots.regions.directory] if snapshots else [])


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
    daemon.events.emit("supervisor_started", pid=os.getpid(), log_dir=str(daemon.log_root),
                       local_world_size=settings.local_world_size,
                       backend=settings.rdzv_backend)
    logger.info("run %s: logs under %s", daemon.run_id, daemon.log_root / daemon.run_id)


# ------------------------------------------------------------------ serve


async def start_tasks(tg: TaskGroup, daemon: Daemon) -> None:
    """Every long-lived task, each started only once the one before it is ready: signal
    handlers before any worker exists, the FIFO open before the first launch."""
    d = daemon
    if not d.embedded:
        await tg.start(deliver_signals, d.outbox)
    await tg.start(run_watchdog_pings, d.notifier)
    await tg.start(d.output.run)
    await d.pool.start_tasks(tg)
    d.pool.warm_up(d.group.preview())  # the fork server imports while we rendezvous
    await tg.start(d.rendezvous.run)
    await tg.start(d.lag.run)
    await tg.start(d.events.retry_pending)
    await tg.start(d.guardian.run)
    await tg.start(d.goodput.run)
    if d.snapshots is not None:
        await tg.start(d.snapshots.run)
    if d.watchdog is not None:
        path = await tg.start(d.watchdog.run)
        logger.info("deadline FIFO at %s", path)
    await tg.start(d.dstate.run)
    health_url = start_serving(tg, d)
    start_summaries(tg, d.rendezvous, d.view.hub, health_url)
    tg.start_soon(publish_status, d.view.hub, d.reporter)


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
    daemon.events.emit("health_listening", host=settings.health_host, port=port)
    tg.start_soon(serve_when_launched, tg, serving)
    return f"http://{advertised_host(settings, daemon.rendezvous)}:{port}"


# ------------------------------------------------------------------ shut down


async def wind_down(daemon: Daemon) -> None:
    """After the controller's last transition: the newest snapshot to disk, the last
    STATUS line, and the rendezvous told how this node ended."""
    if daemon.snapshots is not None:  # the workers are stopped: the newest step to disk
        await daemon.snapshots.finish(daemon.settings.shutdown_timeout)
    daemon.reporter.publish(daemon.view.hub.current)
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
        if daemon.snapshots is not None:
            daemon.snapshots.close()  # the regions: never left behind
        daemon.guardian.close()
        daemon.owners.close()
        daemon.events.close()
        daemon.notifier.close()
    outside.runtime.cleanup()


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


def make_pool(
    settings: Settings,
    rendezvous: Rendezvous,
    environ: Mapping[str, str],
    death: DeathSignal,
    progress: ProgressTable,
    guardian: Guardian,
    *,
    fork_server: bool = False,
    run_dir: Path | None = None,
) -> Pool:
    """The warm pool (``--no-warm-restart``: none, every attempt starts cold; nor where
    no attempt can follow the first and nothing is preloaded: its code is not even
    imported then; nor where no standby can run the command, which ``--preload`` is told
    in one warning line).

    ``fork_server``: with ``--preload``, every attempt's workers start in interpreters
    forked from one fork server per node; only where we are a child subreaper (the
    daemon), so that a forked standby is reparented to us. The embedded API keeps
    standbys that import for themselves (for restarts only).
    ``run_dir``: where ``--preload auto`` keeps what it learned for the next run."""
    second_attempt = attempt_may_follow(0, settings.max_restarts,
                                        rendezvous.capabilities.membership_can_change)
    if settings.no_warm_restart or not (second_attempt or settings.preload):
        return NullPool()
    python = standby_python(environ.get("PYTHON_EXEC", sys.executable),
                            no_python=settings.no_python, script=settings.training_script,
                            args=settings.training_script_args)
    why = (f"{settings.training_script} is not a Python interpreter run as "
           "'PYTHON -u SCRIPT' (or -m MODULE, -c CODE)") if python is None else None
    if python is not None and python != sys.executable:
        from supervisor.workers.warm.interpreter import unsupported

        why = unsupported(python, environ)
    if why is not None:
        if settings.preload:
            logger.warning("preload: no effect, every attempt starts cold: %s", why)
        return NullPool()
    assert python is not None
    from supervisor.workers.warm.pool import WarmPool

    forks = None
    if fork_server and settings.preload:
        from supervisor.workers.warm.forkslot import ForkSlot

        forks = ForkSlot(death=death, prefix=interpreter(python), guardian=guardian)
    return WarmPool(
        settings, python=python, death=death,
        progress=progress,
        membership_can_change=rendezvous.capabilities.membership_can_change,
        guardian=guardian, forks=forks, run_dir=run_dir,
    )


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


def _timer_file(settings: Settings, runtime_dir: Path) -> Path:
    if settings.timer_file:
        return Path(settings.timer_file)
    return runtime_dir / "watchdog" / "timer.fifo"


def make_watchdog(settings: Settings, timer_file: Path, hang_dump: HangDump, owners: OwnerCache,
                  progress: ProgressTable, group: WorkerGroup, outbox: Outbox) -> Watchdog:
    """The deadline FIFO's reader (opened by its task); expired deadlines are reported
    into the inbox, a hang dump goes to the current attempt's rank directory."""

    def dump_path(local_rank: int, pid: int) -> Path | None:
        attempt = group.attempt
        return attempt.directory / str(local_rank) / f"hang-{pid}.txt" if attempt else None

    config = WatchdogConfig(
        kill_grace=min(5.0, max(0.5, settings.shutdown_timeout)),
        hang_dump=hang_dump,
        dump_path=dump_path,
    )
    return Watchdog(timer_file, owner=owners, progress=progress, on_expired=outbox.send,
                    config=config)


class _WatchdogHooks:
    """Keeps the watchdog's and health signals' tables in step with the worker group."""

    def __init__(self, watchdog: Watchdog | None, dstate: DStateMonitor) -> None:
        self.watchdog = watchdog
        self.dstate = dstate

    def on_transition(
        self, old: sm.State, new: sm.State, event: sm.Event, decision: sm.Decision
    ) -> None:
        if isinstance(event, sm.WorkerExited) and self.watchdog is not None:
            self.watchdog.forget_pid(event.pid)

    def on_launch(self, attempt: Attempt) -> None:
        # before any worker of the attempt can post: they are still exec'ing
        if self.watchdog is not None:
            self.watchdog.reset(attempt.number)
        self.dstate.reset(attempt.number)

    def on_stopped(self, attempt: Attempt) -> None:
        if self.watchdog is not None:
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


def identify_worker(group: WorkerGroup, pid: int) -> Sender | None:
    """The live worker of the current attempt that is (or owns) ``pid``, with its ranks.

    Unlike a deadline, a save's commit counts while the attempt is being stopped: a rank
    that finished copying as a peer crashed completes its step (the step to restore is
    decided only once every worker is reaped)."""
    attempt = group.attempt
    if attempt is None:
        return None
    live = {w.pid: w.local_rank for w in attempt.workers if w.status is None}
    local_rank = owner_by_ancestry(pid, live)
    if local_rank is None:
        return None
    return Sender(pid, local_rank, attempt.layout.rank_offset + local_rank)


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


async def publish_status(hub: StatusHub, reporter: StatusReporter) -> None:
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
