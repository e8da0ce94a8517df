"""Prometheus series of the etcd rendezvous, read at scrape time from its live counters.

``EtcdCollector(rdzv)`` is a prometheus-client collector: register it in the supervisor's
registry (``metrics.registry.register(EtcdCollector(rdzv))``) and every scrape reports
whether etcd answers, the outages so far and their length, and the client's requests,
txn conflicts and watch events. Nothing is copied: the values cannot drift from what the
rendezvous sees.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from supervisor.rendezvous.base import EtcdService
from supervisor.rendezvous.etcd.wire.decode import IGNORED

PREFIX = "elastic_supervisor_etcd_"


class EtcdCollector(Collector):
    """The etcd rendezvous' reachability and traffic, as Prometheus series."""

    def __init__(self, rdzv: EtcdService) -> None:
        self._rdzv = rdzv

    def collect(self) -> Iterator[Metric]:
        r = self._rdzv.reachability
        now = time.monotonic()
        yield GaugeMetricFamily(PREFIX + "reachable",
                                "1 while etcd answers, 0 during an outage",
                                value=0.0 if r.unreachable_since is not None else 1.0)
        yield GaugeMetricFamily(PREFIX + "unreachable_seconds",
                                "How long the current etcd outage has lasted (0: none)",
                                value=r.outage_age(now))
        yield CounterMetricFamily(PREFIX + "outages", "etcd outages (no endpoint answered)",
                                  value=r.outages)
        yield CounterMetricFamily(PREFIX + "outage_seconds",
                                  "Seconds etcd was unreachable, the current outage included",
                                  value=r.total_outage + r.outage_age(now))
        yield CounterMetricFamily(PREFIX + "values_ignored",
                                  "Malformed etcd values ignored (decode.SCHEMAS: IGNORE rows)",
                                  value=sum(IGNORED.values()))
        stats = self._rdzv.stats
        for key, doc in (("requests", "etcd requests sent, retries included"),
                         ("txn_conflicts", "etcd transactions whose comparisons failed"),
                         ("failed_attempts", "etcd requests to one endpoint that failed"),
                         ("watch_events", "etcd watch events delivered (each once)")):
            yield CounterMetricFamily(PREFIX + key, doc, value=stats[key])
        notices = CounterMetricFamily(
            "elastic_supervisor_leave_notices", "Leave notices from peers by outcome: "
            "received, refused (malformed or not applicable), confirmed or unconfirmed by "
            "the node named (docs/rendezvous.md, Graceful leave)", labels=["outcome"])
        for outcome, count in self._rdzv.notices.counts.items():
            notices.add_metric([outcome], count)
        yield notices
