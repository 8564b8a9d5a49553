"""The workers' own counters over one run of `kvserve bench gateway` / `python -m benchmarks
gateway`: prefix-cache tokens looked up and hit, and LoRA adapter loads.

`CounterPoller` scrapes every worker's /metrics once a second and sums the increase of the
prefix-cache counters (vLLM's names, which kvserve and vLLM both export), a drop counting as a
restart (Prometheus `increase` semantics), so a fleet's hit rate survives a worker restart.
With a `LoadReader` per worker it sums the increase of that worker's adapter loads alike
(gateway_lora.py says what each kind of worker counts).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from kvserve.gateway.fleet.scraper import apply_metrics
from kvserve.gateway.fleet.worker_pool import WorkerState

LoadReader = Callable[[str], float | None]
"""A worker's /metrics text -> the adapters it has loaded into a slot so far (a counter: it
only grows, or drops when the worker restarts), or None when it cannot say now."""


@dataclass(slots=True)
class CounterTotals:
    """Increases of one worker's counters since polling began: prefix-cache tokens looked up
    (`queries`) and hit, and adapter loads (0 unless a `LoadReader` feeds them)."""

    queries: float = 0.0
    hits: float = 0.0
    loads: float = 0.0
    last_queries: float | None = None
    last_hits: float | None = None
    last_loads: float | None = None

    def add(self, queries: float, hits: float, loads: float | None = None) -> None:
        self.queries += _increase(self.last_queries, queries)
        self.hits += _increase(self.last_hits, hits)
        self.last_queries, self.last_hits = queries, hits
        if loads is not None:
            self.loads += _increase(self.last_loads, loads)
            self.last_loads = loads


def _increase(last: float | None, value: float) -> float:
    """A counter's growth since `last` (None: the first reading); a drop means it restarted."""
    if last is None:
        return 0.0
    return value - last if value >= last else value


class CounterPoller:
    """Polls each worker's /metrics every `interval_s` until stopped (see the module docstring).
    Call `poll_once()` before the run (the baseline) and after it (the final reading).
    `load_readers`, one per worker in `worker_urls`' order, count adapter loads; without them
    `adapter_loads()` is None."""

    def __init__(self, worker_urls: Sequence[str], interval_s: float = 1.0,
                 load_readers: Sequence[LoadReader] | None = None) -> None:
        self.urls = list(worker_urls)
        self.interval_s = interval_s
        self.totals = {url: CounterTotals() for url in self.urls}
        if load_readers is not None and len(load_readers) != len(self.urls):
            raise ValueError(f"{len(load_readers)} load readers for {len(self.urls)} workers")
        self.load_readers = (dict(zip(self.urls, load_readers, strict=True))
                             if load_readers is not None else None)

    async def poll_once(self, client: httpx.AsyncClient) -> None:
        for url in self.urls:
            try:
                resp = await client.get(f"{url}/metrics", timeout=2.0)
                resp.raise_for_status()
            except httpx.HTTPError:
                continue  # down (being restarted): its next reading catches up
            state = WorkerState(url=url)
            apply_metrics(state, resp.text)
            loads = self.load_readers[url](resp.text) if self.load_readers else None
            self.totals[url].add(state.prefix_queries, state.prefix_hits, loads)

    async def run(self, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        """Poll until `stop` is set, then once more; `ready` is set after the baseline."""
        async with httpx.AsyncClient() as client:
            await self.poll_once(client)
            if ready is not None:
                ready.set()
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval_s)
                await self.poll_once(client)

    def hit_rate(self) -> float:
        queries = sum(t.queries for t in self.totals.values())
        hits = sum(t.hits for t in self.totals.values())
        return hits / queries if queries else float("nan")

    def shares(self) -> list[float]:
        """Each worker's share of the prompt tokens looked up fleet-wide (its load)."""
        total = sum(t.queries for t in self.totals.values())
        return [self.totals[u].queries / total if total else float("nan") for u in self.urls]

    def adapter_loads(self) -> list[float] | None:
        """Each worker's adapter loads over the run (None without load readers)."""
        if self.load_readers is None:
            return None
        return [self.totals[u].loads for u in self.urls]
