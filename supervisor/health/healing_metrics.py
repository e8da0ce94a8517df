"""Prometheus series of healing (``supervisor.healing``), read at scrape time.

Counters: ``elastic_supervisor_node_check_runs_total``, ``..._node_check_failures_total``,
``..._node_quarantines_total``, ``..._spare_admissions_total``, ``..._remote_failures_total``
(failures of this node's workers that were another node's consequence). Gauges:
``elastic_supervisor_node_spare`` (1 while this node waits as a spare) and
``elastic_supervisor_node_held`` (1 while it is kept out: quarantined, or failing its
check before joining). Every series exists from the first scrape, at 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from supervisor.healing import Healing

PREFIX = "elastic_supervisor_"


class HealingCollector(Collector):
    """This node's checks, quarantines and spare admissions, as Prometheus series."""

    def __init__(self, healing: Healing) -> None:
        self._healing = healing

    def collect(self) -> Iterator[Metric]:
        h = self._healing
        checker = h.checker
        counters = (
            ("node_check_runs", "Node check runs (built-in and --node-check)",
             checker.runs if checker else 0),
            ("node_check_failures", "Node check runs that found the node unhealthy",
             checker.failures if checker else 0),
            ("node_quarantines", "Times this node quarantined itself", h.quarantines),
            ("spare_admissions", "Rounds that admitted this node after it waited as a spare",
             h.spare_admissions),
            ("remote_failures", "Worker failures that were another node's consequence "
             "(no restart used)", h.remote_failures),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        yield GaugeMetricFamily(PREFIX + "node_spare", "1 while this node waits as a spare",
                                value=1.0 if h.ledger.spare else 0.0)
        held = h.state in ("held", "unhealthy", "quarantined")
        yield GaugeMetricFamily(PREFIX + "node_held", "1 while this node is kept out of the "
                                "job (quarantined, or failing its node check)",
                                value=1.0 if held else 0.0)
