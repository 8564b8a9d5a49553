"""Keeps a `WorkerPool` equal to the discovered fleet: static workers, every address of some DNS
names (re-resolved each interval: a Kubernetes headless Service) and a workers file (re-read
when it changes: a mounted ConfigMap). One small asyncio task any front end can start and stop.

A source that fails (DNS error, missing or unreadable file, a bad line) keeps its last known
workers and is logged once until it recovers: a transient failure never empties the pool. A
worker that leaves drains (`WorkerPool.remove`), so its requests in flight finish.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence

from kvserve.gateway.fleet.discovery.sources import (
    DnsName,
    FileSignature,
    FleetChange,
    fleet_change,
    normalize_worker_url,
    parse_workers_file,
    worker_urls,
)
from kvserve.gateway.fleet.worker_pool import WorkerPool

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""A name and port -> the addresses it resolves to now; raises OSError, TimeoutError or
ValueError when it cannot tell."""

SOURCES = ("static", "dns", "file")
DEFAULT_INTERVAL_S = 5.0
RESOLVE_TIMEOUT_S = 5.0


async def system_resolver(host: str, port: int) -> list[str]:
    """Every A and AAAA address of `host`, from the system resolver (getaddrinfo in a thread,
    as the event loop does), within RESOLVE_TIMEOUT_S."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(RESOLVE_TIMEOUT_S):
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


class WorkerDiscovery:
    """Discovers the fleet into `pool`: `refresh_once()` now, `run()` (or `start()`/`stop()`)
    every `interval_s`. Workers that appear are added (and handed to `on_added`, e.g. to scrape
    them at once); those that leave are removed, draining. Raises ValueError at construction
    for a workers file that is missing or bad (nothing to keep yet), saying how to fix it."""

    def __init__(self, pool: WorkerPool, static: Iterable[str] = (),
                 dns_names: Sequence[DnsName] = (), workers_file: str | None = None,
                 interval_s: float = DEFAULT_INTERVAL_S, resolver: Resolver = system_resolver,
                 on_added: Callable[[Sequence[str]], Awaitable[None]] | None = None) -> None:
        if not 0.0 < interval_s < float("inf"):
            raise ValueError(f"--discovery-interval must be a positive number of seconds, got "
                             f"{interval_s}")
        self.pool = pool
        self.static = frozenset(normalize_worker_url(url) for url in static)
        self.dns_names = tuple(dict.fromkeys(dns_names))
        self.workers_file = workers_file
        self.interval_s = interval_s
        self.resolver = resolver
        self.on_added = on_added
        self.errors = dict.fromkeys(SOURCES, 0)  # failed reads per source, ever
        self._dns: dict[DnsName, frozenset[str]] = {}  # last good answer per name
        self._file: frozenset[str] = frozenset()
        self._file_signature: FileSignature | None = None
        self._failing: dict[str, str] = {}  # what -> the error last logged for it
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        if workers_file is not None:
            try:
                self._file_signature = FileSignature.of(workers_file)
                with open(workers_file, encoding="utf-8") as f:
                    self._file = parse_workers_file(f.read(), workers_file)
            except OSError as exc:
                raise ValueError(f"--workers-file {workers_file}: {exc.strerror or exc}; create "
                                 "it with one worker URL per line (for a mounted ConfigMap, "
                                 "check the volume's mountPath and the key's file name)") from None
            except UnicodeDecodeError as exc:
                raise ValueError(f"--workers-file {workers_file} is not UTF-8 text ({exc}); "
                                 "write one worker URL per line") from None

    @property
    def discovered(self) -> dict[str, int]:
        """Workers each source names now (its last known answer)."""
        dns: set[str] = set().union(*self._dns.values())
        return {"static": len(self.static), "dns": len(dns), "file": len(self._file)}

    def fleet(self) -> frozenset[str]:
        """The union of every source's last known workers."""
        return self.static.union(*self._dns.values(), self._file)

    async def refresh_once(self) -> FleetChange:
        """Read every source once and make the pool's fleet their union: what was added and
        removed. Never raises for a failing source (it keeps its last known workers)."""
        async with self._lock:
            await asyncio.gather(*(self._resolve(name) for name in self.dns_names))
            self._reread_file()
            change = fleet_change(self.pool.active_urls(), self.fleet())
            for url in change.removed:
                self.pool.remove(url)
            for url in change.added:
                self.pool.add(url)
            if change:
                log.info("kvserve gateway: workers added %s, removed (draining) %s",
                         list(change.added) or "none", list(change.removed) or "none")
            if change.added and self.on_added is not None:
                await self.on_added(change.added)
            return change

    async def run(self) -> None:
        """`refresh_once` every `interval_s`, until cancelled. A round that fails past the
        sources (in `on_added`) is logged and the next one runs: discovery never stops."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh_once()
            except Exception:
                log.exception("kvserve gateway: a discovery round failed; retrying in %.1fs",
                              self.interval_s)

    def start(self) -> None:
        """Run `run()` as a background task of the running loop."""
        self._task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _resolve(self, name: DnsName) -> None:
        try:
            addresses = await self.resolver(name.host, name.port)
        except (OSError, TimeoutError, ValueError) as exc:  # ValueError: an invalid name
            self._failed("dns", f"--worker-dns {name}", f"{type(exc).__name__}: {exc}")
            return
        self._recovered(f"--worker-dns {name}")
        self._dns[name] = worker_urls(addresses, name.port)

    def _reread_file(self) -> None:
        """Re-read the workers file if its signature changed; a file that cannot be read or
        parsed keeps the previous set (a bad version is not read again until it changes)."""
        path = self.workers_file
        if path is None:
            return
        what = f"--workers-file {path}"
        try:
            signature = FileSignature.of(path)
            if signature == self._file_signature:
                return
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            self._failed("file", what, f"{type(exc).__name__}: {exc}")
            return
        self._file_signature = signature
        try:
            self._file = parse_workers_file(text, path)
        except ValueError as exc:
            self._failed("file", what, str(exc))
            return
        self._recovered(what)

    def _failed(self, source: str, what: str, error: str) -> None:
        self.errors[source] += 1
        if self._failing.get(what) != error:
            self._failing[what] = error
            log.warning("kvserve gateway: cannot read %s (%s); keeping its last known workers "
                        "until it can be read", what, error)

    def _recovered(self, what: str) -> None:
        if self._failing.pop(what, None) is not None:
            log.info("kvserve gateway: %s can be read again", what)
