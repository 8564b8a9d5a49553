"""Discovery's Prometheus series, read at scrape time from a `WorkerDiscovery`: register one
`DiscoveryCollector` in the front end's registry (the proxy's and the Endpoint Picker's alike)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvserve.gateway.fleet.discovery.watch import SOURCES, WorkerDiscovery


class DiscoveryCollector(Collector):
    """`kvserve:gateway_discovered_workers{source}` and
    `kvserve:gateway_discovery_errors_total{source}` (static, dns, file)."""

    def __init__(self, discovery: WorkerDiscovery) -> None:
        self.discovery = discovery

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        discovered = GaugeMetricFamily("kvserve:gateway_discovered_workers", "Workers each "
                                       "discovery source names now (its last known answer; "
                                       "a worker may come from several).", labels=["source"])
        errors = CounterMetricFamily("kvserve:gateway_discovery_errors", "Failed reads of a "
                                     "discovery source (DNS errors, a missing or bad workers "
                                     "file); the source keeps its last known workers.",
                                     labels=["source"])
        counts = self.discovery.discovered
        for source in SOURCES:
            discovered.add_metric([source], counts[source])
            errors.add_metric([source], self.discovery.errors[source])
        yield discovered
        yield errors
