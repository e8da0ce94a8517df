"""The health endpoint's serving, started by the composition root once the first group is
launched: what it serves and what its metrics watch are handed over when it is made
(``Serving``), so it never reaches through the controller for them.

aiohttp and prometheus-client are imported here only inside ``serve_when_launched``, in a
thread: importing them before the first launch would delay every worker's start.
"""

from __future__ import annotations

import functools
import gc
import importlib
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread
import msgspec
from anyio.abc import TaskGroup

from supervisor.accounting import GoodputRecorder
from supervisor.controller import Observer
from supervisor.core.statusview import ProgressTable, StatusView
from supervisor.events import EventLog
from supervisor.healing import Healing
from supervisor.health.looplag import LoopLag
from supervisor.rendezvous.base import EtcdService
from supervisor.snapshots.service import SnapshotService
from supervisor.views import StatusHub
from supervisor.watchdog.timers import Watchdog
from supervisor.workers.output import OutputPlan
from supervisor.workers.warm.base import Pool

if TYPE_CHECKING:
    from supervisor.health.metrics import Metrics


SERVE_DEFER = 0.5  # seconds the health server may wait for the first launch before serving
HTTP_STACK = ("supervisor.health.metrics", "supervisor.health.server")


def import_modules(*names: str) -> None:
    """Import what serving needs (aiohttp, prometheus-client): run in a thread."""
    for name in names:
        importlib.import_module(name)


class Serving(msgspec.Struct, frozen=True, kw_only=True):
    """What the health endpoint serves and its metrics read, handed over when it is made."""

    sock: socket.socket  # bound and listening already
    launched: anyio.Event  # set once the first group is launched
    started: float  # the supervisor's start (monotonic)
    attach: Callable[[Observer], None]  # hear the transitions, and those already heard
    hub: StatusHub
    progress: ProgressTable
    lag: LoopLag
    watchdog: Watchdog | None
    goodput: GoodputRecorder
    events: EventLog
    output: OutputPlan
    pool: Pool
    etcd: EtcdService | None
    healing: Healing | None
    snapshots: SnapshotService | None
    freeze: bool  # the daemon, not the embedded API: freeze the heap once serving


async def serve_when_launched(tg: TaskGroup, serving: Serving) -> None:
    """Serve HTTP once the first group is launched (or SERVE_DEFER passed, for a long
    rendezvous): importing aiohttp and prometheus-client costs ~100 ms, which would
    otherwise delay every worker's start. The socket is already bound and listening.
    With ``freeze`` (the daemon, not the embedded API) the heap is frozen once serving."""
    with anyio.move_on_after(SERVE_DEFER):
        await serving.launched.wait()
    # imported in a thread: the loop goes on reading the FIFO, pidfds and output meanwhile
    # (~100 ms here, seconds on a loaded node, which would stamp deadline posts late)
    extra = (("supervisor.rendezvous.etcd.metrics",) if serving.etcd is not None else ()) + (
        ("supervisor.health.healing_metrics",) if serving.healing is not None else ()) + (
        ("supervisor.health.snapshot_metrics",) if serving.snapshots is not None else ())
    await anyio.to_thread.run_sync(functools.partial(import_modules, *HTTP_STACK, *extra))
    from supervisor.health.server import serve_health

    metrics = make_metrics(serving)
    if serving.freeze:  # before serving: the first scrape already shows it
        freeze_heap()
    etcd = serving.etcd
    serve = functools.partial(serve_health, sock=serving.sock,
                              notices=etcd.notices.receive if etcd is not None else None)
    await tg.start(
        serve, "", 0, functools.partial(current_view, serving.hub, serving.snapshots),
        serving.progress, metrics, serving.lag.current
    )


def make_metrics(serving: Serving) -> Metrics:
    """The metrics, told all that happened so far and watching what they count."""
    from supervisor.health.metrics import Metrics

    metrics = Metrics(started=serving.started,
                      watchdog=serving.watchdog.stats if serving.watchdog is not None else None)
    serving.attach(metrics)
    if serving.etcd is not None:
        from supervisor.rendezvous.etcd.metrics import EtcdCollector

        metrics.registry.register(EtcdCollector(serving.etcd))
    if serving.healing is not None:
        from supervisor.health.healing_metrics import HealingCollector

        metrics.registry.register(HealingCollector(serving.healing))
    if serving.snapshots is not None:
        from supervisor.health.snapshot_metrics import SnapshotCollector

        metrics.registry.register(SnapshotCollector(serving.snapshots))
    metrics.watch_loop(serving.lag)
    metrics.watch_event_log(serving.events)
    metrics.watch_output(serving.output.loss)
    metrics.watch_warm(serving.pool)
    serving.goodput.attach_metrics(metrics)
    return metrics


def current_view(hub: StatusHub, snapshots: SnapshotService | None) -> StatusView:
    """What HTTP readers see: the last published view, with the snapshot counts of now
    (a save changes them between two transitions; republishing at every save would wake
    every reader of the view, the status summaries in etcd among them)."""
    if snapshots is None:
        return hub.current
    return msgspec.structs.replace(hub.current, snapshots=snapshots.status())


async def freeze_when_launched(launched: anyio.Event) -> None:
    """``freeze_heap`` once the first group is launched, for a daemon without HTTP."""
    with anyio.move_on_after(SERVE_DEFER):
        await launched.wait()
    freeze_heap()


def freeze_heap() -> None:
    """Move what start-up left on the heap (modules, settings, the HTTP stack: about 48,000
    objects) to the collector's permanent generation, as a pre-forking server does: every
    full collection would otherwise walk them all again, holding the loop 14-68 ms each
    (measured under issue 29's load on a 2-core machine, two or three per 20 s). No
    ``gc.collect()`` first: that would hold the loop as long, right after the launch (the
    start-up's garbage, 34-135 objects when probed, stays). The cost: what is alive then
    and later dies in a reference cycle is never freed (the first attempt's objects at
    most, once). A daemon only: the embedded API leaves its host's collector alone."""
    gc.freeze()  # moves the generations' lists: no walk of the heap
