"""Load signals: each worker's /health and /metrics, polled every `interval_s`.

Reads the vLLM-named series every OpenAI-compatible worker we front exports (kvserve's and
vLLM's; SGLang's under its own names where they differ), so the policies see queue depth and KV
usage with at most one interval of staleness.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvserve.gateway.periodic import Periodic
from kvserve.gateway.worker_pool import WorkerPool, WorkerState

# metric family name (as the parser reports it) -> WorkerState field
_SERIES = {
    "vllm:num_requests_running": "num_running",
    "vllm:num_requests_waiting": "num_waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:prefix_cache_queries": "prefix_queries",
    "vllm:prefix_cache_hits": "prefix_hits",
    "sglang:num_running_reqs": "num_running",
    "sglang:num_queue_reqs": "num_waiting",
    "sglang:max_total_num_tokens": "kv_capacity_tokens",
}
CACHE_CONFIG_INFO = "vllm:cache_config_info"
"""kvserve's and vLLM's KV configuration, in labels: capacity = num_gpu_blocks x block_size."""


def _capacity_from_info(labels: dict[str, str]) -> int | None:
    """Tokens of KV cache from a cache_config_info sample (None before the worker sized it:
    vLLM reports num_gpu_blocks="None" until then)."""
    blocks, block_size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
    if not (blocks.isdigit() and block_size.isdigit()):
        return None
    return int(blocks) * int(block_size) or None


def apply_metrics(worker: WorkerState, text: str) -> bool:
    """Update `worker` from a Prometheus text exposition (sums over label sets). Returns True
    when the worker restarted since the last scrape: its prefix-cache query counter went
    down, which a counter does only in a new process (whose cache starts empty)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == CACHE_CONFIG_INFO:
            capacities = [_capacity_from_info(s.labels) for s in family.samples]
            known = [c for c in capacities if c is not None]
            if known:
                totals["kv_capacity_tokens"] = float(sum(known))
            continue
        field = _SERIES.get(family.name)
        if field is None:
            continue
        for sample in family.samples:
            if sample.name.endswith(("_created", "_bucket", "_sum", "_count")):
                continue
            totals[field] = totals.get(field, 0.0) + sample.value
    worker.num_running = int(totals.get("num_running", worker.num_running))
    worker.num_waiting = int(totals.get("num_waiting", worker.num_waiting))
    worker.kv_usage = totals.get("kv_usage", worker.kv_usage)
    worker.kv_capacity_tokens = int(totals.get("kv_capacity_tokens", worker.kv_capacity_tokens))
    queries = totals.get("prefix_queries", worker.prefix_queries)
    restarted = queries < worker.prefix_queries
    worker.prefix_queries = queries
    worker.prefix_hits = totals.get("prefix_hits", worker.prefix_hits)
    return restarted


class Scraper(Periodic):
    """Polls every worker; runs as one background task on the gateway's event loop. A worker
    seen restarted (`apply_metrics`) is reported to `on_restart(url)`: a routing policy's index
    of what it cached is stale from then on. A worker's KV capacity in tokens, when first seen
    and whenever it changes, goes to `on_capacity(url, tokens)`: how much a policy's index of it
    may hold."""

    def __init__(self, pool: WorkerPool, client: httpx.AsyncClient, interval_s: float = 1.0,
                 on_restart: Callable[[str], None] | None = None,
                 on_capacity: Callable[[str, int], None] | None = None):
        self.pool = pool
        self.client = client
        self.interval_s = interval_s
        self.on_restart = on_restart
        self.on_capacity = on_capacity

    async def scrape_once(self) -> None:
        await asyncio.gather(*(self._scrape(w) for w in self.pool.workers.values()))

    tick = scrape_once

    async def _scrape(self, worker: WorkerState) -> None:
        now = time.monotonic()
        try:
            health = await self.client.get(f"{worker.url}/health", timeout=2.0)
            ok = health.status_code == 200
            error = None if ok else f"/health answered {health.status_code}"
            self.pool.record_health(worker.url, ok, now, error)
            if ok:
                metrics = await self.client.get(f"{worker.url}/metrics", timeout=2.0)
                if metrics.status_code == 200:
                    capacity = worker.kv_capacity_tokens
                    restarted = apply_metrics(worker, metrics.text)
                    worker.last_scrape = now
                    if restarted and self.on_restart is not None:
                        self.on_restart(worker.url)
                    if (worker.kv_capacity_tokens != capacity and worker.kv_capacity_tokens > 0
                            and self.on_capacity is not None):
                        self.on_capacity(worker.url, worker.kv_capacity_tokens)
        except (httpx.HTTPError, ValueError) as exc:
            self.pool.record_health(worker.url, False, now, f"{type(exc).__name__}: {exc}")
