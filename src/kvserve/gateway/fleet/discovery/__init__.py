"""Workers that come and go: the fleet from static URLs, DNS names (a headless Service) and a
workers file (a ConfigMap), kept in a `WorkerPool` without a restart."""

from kvserve.gateway.fleet.discovery.metrics import DiscoveryCollector
from kvserve.gateway.fleet.discovery.sources import (
    DnsName,
    FileSignature,
    FleetChange,
    WorkersFileError,
    fleet_change,
    normalize_worker_url,
    parse_workers_file,
    worker_urls,
)
from kvserve.gateway.fleet.discovery.watch import (
    DEFAULT_INTERVAL_S,
    Resolver,
    WorkerDiscovery,
    system_resolver,
)

__all__ = [
    "DEFAULT_INTERVAL_S",
    "DiscoveryCollector",
    "DnsName",
    "FileSignature",
    "FleetChange",
    "Resolver",
    "WorkerDiscovery",
    "WorkersFileError",
    "fleet_change",
    "normalize_worker_url",
    "parse_workers_file",
    "system_resolver",
    "worker_urls",
]
