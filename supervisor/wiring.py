"""The daemon's parts and how they are made (``wire``), each handed what it uses.

Nothing here runs: ``app.start_tasks`` starts the parts' tasks. The parts are grouped by
what they are for (``Records``, ``Workers``, ``Control``, ``Watchers``, the health
endpoint's ``Serving``); ``Hooks`` carries the few reports that reach a part made after
their sender.
"""

from __future__ import annotations

import logging
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import msgspec

from supervisor.accounting import GoodputRecorder
from supervisor.config import Settings
from supervisor.controller import (
    Attempt,
    CommandFor,
    Controller,
    Inbox,
    InboxItem,
    Observer,
    Outbox,
    restart_policy,
)
from supervisor.core import state as sm
from supervisor.core.envs import default_omp_threads, interpreter, standby_python
from supervisor.core.slots import Restore
from supervisor.core.statusview import ProgressTable
from supervisor.core.warm import attempt_may_follow
from supervisor.events import EventLog
from supervisor.healing import Healing, make_healing
from supervisor.health.looplag import LoopLag
from supervisor.rendezvous.base import Rendezvous, RendezvousResult
from supervisor.rendezvous.etcd.persist_mark import PersistMarks
from supervisor.serving import Serving
from supervisor.snapshot import ENV_VAR as SNAPSHOT_ENV
from supervisor.snapshots.channel import Sender
from supervisor.snapshots.service import SnapshotService, build_snapshots
from supervisor.startup import Outside, Plan
from supervisor.systemd import (
    NOTIFY_ENV_VARS,
    Notifier,
    StatusReporter,
    extending_timeout,
)
from supervisor.views import ReadModel
from supervisor.watchdog.dstate import DStateMonitor
from supervisor.watchdog.escalate import HangDump
from supervisor.watchdog.owners import OwnerCache, owner_by_ancestry
from supervisor.watchdog.timers import Watchdog, WatchdogConfig
from supervisor.workers.group import WorkerGroup
from supervisor.workers.guardian import COOKIE_ENV, Guardian, set_child_subreaper
from supervisor.workers.nodecheck import CheckLauncher
from supervisor.workers.output import OutputPlan
from supervisor.workers.spawn import DeathSignal
from supervisor.workers.warm.base import NullPool, Pool

logger = logging.getLogger("supervisor.app")  # its lines were always the composition root's


class Hooks:
    """The reports that reach parts made after their sender. The rendezvous (it connects
    before the event log exists) reports etcd outages; goodput, healing and the snapshot
    service (made before the read model that shows them) say that what it shows changed;
    the snapshot service (made before the worker group, whose workers get its socket's
    path) asks which worker a pid is and which round is being launched, and reports a restore
    to the event log and goodput. ``connect`` is called once all exist, before any task
    runs, which is the first that can report."""

    def __init__(self) -> None:
        self._parts: _Hooked | None = None

    def connect(self, events: EventLog, view: ReadModel, group: WorkerGroup,
                goodput: GoodputRecorder, controller: Controller) -> None:
        self._parts = _Hooked(events, view, group, goodput, controller)

    @property
    def parts(self) -> _Hooked:
        assert self._parts is not None, "a report before the parts were connected"
        return self._parts

    def etcd_event(self, kind: str, **fields: Any) -> None:
        """An etcd outage, its end, a replaced lease: logged and shown in /status."""
        self.parts.events.emit(kind, **fields)
        self.changed()

    def changed(self) -> None:
        """What the read model shows changed outside a transition: publish it again."""
        self.parts.view.publish()

    def identify(self, pid: int) -> Sender | None:
        return identify_worker(self.parts.group, pid)

    def placement(self) -> RendezvousResult | None:
        """The last round accepted (the one being launched), if any."""
        return self.parts.controller.round

    def restored(self, restore: Restore | None) -> None:
        if restore is not None:
            self.parts.events.emit("snapshot_restored", step=restore.step,
                                   source=restore.source, newest=restore.newest,
                                   replicated=restore.replicated)
            self.parts.goodput.on_restored(restore.step, restore.newest, restore.saved_at,
                                           restore.source)


class _Hooked(msgspec.Struct, frozen=True):
    events: EventLog
    view: ReadModel
    group: WorkerGroup
    goodput: GoodputRecorder
    controller: Controller


class Daemon(msgspec.Struct, frozen=True):
    """Every part of the running supervisor, made by ``wire``."""

    settings: Settings
    run_id: str
    log_root: Path
    embedded: bool
    outside: Outside
    records: Records
    workers: Workers
    control: Control
    watchers: Watchers
    serving: Serving | None
    inbox: Inbox
    outbox: Outbox

    @property
    def rendezvous(self) -> Rendezvous:
        return self.outside.rendezvous

    @property
    def controller(self) -> Controller:
        return self.control.controller


def wire(plan: Plan, outside: Outside, environ: Mapping[str, str], hooks: Hooks, *,
         command: CommandFor | None, embedded: bool) -> Daemon:
    """Make every part, each handed what it uses; nothing runs yet."""
    records = make_records(plan, environ, embedded=embedded)
    outbox, inbox = anyio.create_memory_object_stream[InboxItem](max_buffer_size=4096)
    workers = make_workers(plan, outside, environ, records, hooks, outbox.send_nowait,
                           command=command, embedded=embedded)
    control = make_control(plan, outside, records, workers, hooks)
    hooks.connect(records.events, control.view, workers.group, control.goodput,
                  control.controller)
    watchers = make_watchers(plan, outside, records.progress, workers.group,
                             control.controller, outbox)
    serving = make_serving(outside, records, workers, control, watchers.watchdog,
                           embedded=embedded)
    return Daemon(outside.settings, plan.run_id, plan.log_root, embedded, outside, records,
                  workers, control, watchers, serving, inbox, outbox)


class Records(msgspec.Struct, frozen=True):
    """What the run is recorded and reported with."""

    events: EventLog
    notifier: Notifier
    reporter: StatusReporter
    lag: LoopLag
    output: OutputPlan
    progress: ProgressTable


def make_records(plan: Plan, environ: Mapping[str, str], *, embedded: bool) -> Records:
    """The event log (told of loop stalls and lost output), systemd's notifier and the
    progress table (a line matching --progress-pattern is progress when a rank posts no
    deadlines)."""
    events = EventLog(plan.event_log, plan.run_id, root=plan.log_root)
    notifier = Notifier(None) if embedded else Notifier.from_environ(environ)
    lag = LoopLag()
    lag.add_listener(lambda stall: events.emit("loop_stall", **stall.fields()))
    output = plan.output
    output.loss.listeners.append(lambda name, fields: events.emit(name, **fields))
    progress = ProgressTable()
    output.on_progress_line = lambda local_rank: progress.touch_output(local_rank,
                                                                       time.monotonic())
    return Records(events, notifier, StatusReporter(notifier), lag, output, progress)


class Workers(msgspec.Struct, frozen=True):
    """What starts, keeps and stops the workers."""

    snapshots: SnapshotService | None
    guardian: Guardian
    pool: Pool
    group: WorkerGroup
    base_env: dict[str, str]
    death: DeathSignal


def make_workers(plan: Plan, outside: Outside, environ: Mapping[str, str], records: Records,
                 hooks: Hooks, post: Callable[[InboxItem], None], *,
                 command: CommandFor | None, embedded: bool) -> Workers:
    """The snapshot service, the guardian, the warm pool and the worker group."""
    settings, rendezvous = outside.settings, outside.rendezvous
    if not embedded:
        set_child_subreaper()
    snapshots = build_snapshots(
        settings, coordinates_nodes=rendezvous.capabilities.coordinates_nodes,
        runtime_dir=outside.runtime.path, progress=records.progress,
        identify=hooks.identify, changed=hooks.changed, on_restore=hooks.restored,
        placement=hooks.placement, disk=outside.snapshot_disk)
    etcd = rendezvous.etcd_service()
    if snapshots is not None and etcd is not None:  # told when this node joins a round
        etcd.snapshot_report = snapshots.report
        snapshots.marks = PersistMarks(etcd)  # the steps every node persists
    cookie = uuid.uuid4().hex
    # the guardian also removes the runtime directory and the snapshot regions if we die
    # (a SIGKILL skips every cleanup)
    guardian = Guardian(cookie, runtime_dir=outside.runtime.path if outside.runtime.owned
                        else None,
                        also_remove=[snapshots.regions.directory] if snapshots else [])
    death = DeathSignal()
    pool = make_pool(settings, rendezvous, environ, death, records.progress, guardian,
                     fork_server=not embedded, run_dir=plan.log_root / plan.run_id)
    base_env = worker_base_env(environ, settings.local_world_size, cookie)
    if snapshots is not None:  # the only variable of ours a worker gets
        base_env[SNAPSHOT_ENV] = str(snapshots.socket_path)
    group = WorkerGroup(
        settings, run_id=plan.run_id, events=records.events, log_root=plan.log_root,
        output=records.output, environ=base_env, timer_file=outside.timer_path,
        post=post, death=death, pool=pool, guardian=guardian,
        exempt_pids=[guardian.pid, *rendezvous.extra_pids()],
        sweep_adopted=not embedded, command=command, cpus=plan.cpus,
    )
    return Workers(snapshots, guardian, pool, group, base_env, death)


class Control(msgspec.Struct, frozen=True):
    """What decides (the controller) and what it tells (healing, goodput, the read model)."""

    healing: Healing
    goodput: GoodputRecorder
    view: ReadModel
    controller: Controller


def make_control(plan: Plan, outside: Outside, records: Records, workers: Workers,
                 hooks: Hooks) -> Control:
    """Healing, goodput, the read model and the controller with its observers."""
    settings, rendezvous, events = outside.settings, outside.rendezvous, records.events
    group, snapshots, sock = workers.group, workers.snapshots, outside.sock
    policy = restart_policy(settings)
    healing = make_healing(settings, rendezvous, events, workers.base_env, plan.run_id,
                           plan.log_root, launcher=CheckLauncher(workers.death,
                                                                 workers.guardian),
                           changed=hooks.changed)
    goodput = GoodputRecorder(
        events, records.progress, started=time.monotonic(), bound=settings.progress_timeout,
        republish=hooks.changed, shown=group.shown_attempt,
    )
    etcd = rendezvous.etcd_service()
    view = ReadModel(
        settings, run_id=plan.run_id, backend=rendezvous.backend, group=group, policy=policy,
        events=events, output=records.output, timer_file=outside.timer_path,
        health_port=sock.getsockname()[1] if sock is not None else None, goodput=goodput,
        service_status=etcd.outage_status if etcd is not None else None,
        members_checked=rendezvous.capabilities.coordinates_nodes or settings.max_nodes == 1,
        node_health=healing,
        snapshots=snapshots.status if snapshots is not None else None,
    )
    observers: list[Observer] = [_StopNotice(records.reporter), goodput]
    if snapshots is not None:  # before the launch it observes: the restore step first
        observers.insert(0, snapshots)
    notifier = records.notifier
    controller = Controller(
        settings, rendezvous, group=group, view=view, policy=policy, events=events,
        output=records.output, progress=records.progress, observers=observers,
        stop_guard=lambda: extending_timeout(notifier), healing=healing,
        late_observer=sock is not None,  # the metrics, attached by serve_when_launched
    )
    return Control(healing, goodput, view, controller)


class Watchers(msgspec.Struct, frozen=True):
    """What watches the workers from outside: the deadline FIFO and the D-state check."""

    owners: OwnerCache
    watchdog: Watchdog | None
    dstate: DStateMonitor


def make_watchers(plan: Plan, outside: Outside, progress: ProgressTable, group: WorkerGroup,
                  controller: Controller, outbox: Outbox) -> Watchers:
    """The deadline FIFO's reader (unless --no-watchdog) and the D-state check, which runs
    whether or not the FIFO does; both keep their tables in step with the group."""
    owners = OwnerCache(controller.live_worker_ranks)  # whose deadline requests are whose
    watchdog = None if outside.timer_file is None else make_watchdog(
        outside.settings, outside.timer_file, plan.hang_dump, owners, progress, group, outbox)
    dstate = DStateMonitor(controller.live_worker_ranks, outbox.send,
                           hang_state_timeout=outside.settings.hang_state_timeout)
    controller.attach(_WatchdogHooks(watchdog, dstate))
    return Watchers(owners, watchdog, dstate)


def make_serving(outside: Outside, records: Records, workers: Workers, control: Control,
                 watchdog: Watchdog | None, *, embedded: bool) -> Serving | None:
    """What the health endpoint serves and its metrics watch (None: --no-health)."""
    if outside.sock is None:
        return None
    controller = control.controller
    return Serving(
        sock=outside.sock, launched=controller.launched, started=controller.started,
        attach=controller.attach_late, hub=control.view.hub, progress=records.progress,
        lag=records.lag, watchdog=watchdog, goodput=control.goodput, events=records.events,
        output=records.output, pool=workers.pool, etcd=outside.rendezvous.etcd_service(),
        healing=control.healing, snapshots=workers.snapshots, freeze=not embedded)


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
