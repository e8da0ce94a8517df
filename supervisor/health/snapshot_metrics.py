"""Prometheus series of training-state snapshots (``supervisor.snapshots``), read at
scrape time.

Gauges: ``elastic_supervisor_snapshot_memory_bytes`` (shared memory reserved for
snapshots on this node), ``..._snapshot_restored_step`` (the step this attempt restored,
-1 if none). Counters: ``..._snapshot_saves_total`` (saves kept),
``..._snapshot_saves_not_kept_total{reason}`` (refused, no_room, over_limit) and
``..._snapshot_messages_refused_total{kind}`` (malformed, forged, foreign messages on the
snapshot socket). Every series exists from the first scrape.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from supervisor.snapshots.service import SnapshotService

PREFIX = "elastic_supervisor_snapshot_"


class SnapshotCollector(Collector):
    """This node's snapshot memory, saves and refusals, as Prometheus series."""

    def __init__(self, service: SnapshotService) -> None:
        self._service = service

    def collect(self) -> Iterator[Metric]:
        service = self._service
        yield GaugeMetricFamily(PREFIX + "memory_bytes", "Shared memory reserved for "
                                "training-state snapshots on this node",
                                value=service.table.memory())
        restore = service.table.restore
        yield GaugeMetricFamily(PREFIX + "restored_step", "The step this attempt restored "
                                "(-1: none)", value=restore.step if restore else -1)
        yield CounterMetricFamily(PREFIX + "saves", "Snapshot saves kept",
                                  value=service.counts.kept)
        counts = service.counts
        not_kept = CounterMetricFamily(PREFIX + "saves_not_kept", "Snapshot saves not kept",
                                       labels=["reason"])
        for reason, value in (("refused", counts.refused), ("no_room", counts.no_room),
                              ("over_limit", counts.over_limit)):
            not_kept.add_metric([reason], value)
        yield not_kept
        channel = service.channel.counts
        refused = CounterMetricFamily(PREFIX + "messages_refused", "Messages on the snapshot "
                                      "socket refused", labels=["kind"])
        for kind, value in (("malformed", channel.malformed), ("forged", channel.forged),
                            ("foreign", channel.foreign)):
            refused.add_metric([kind], value)
        yield refused
