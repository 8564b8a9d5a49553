"""Load signals: each worker's /health and /metrics, polled every `interval_s`.

Reads the vLLM-named series every OpenAI-compatible worker we front exports (kvserve's and
vLLM's; SGLang's under its own names where they differ), so the policies see queue depth and KV
usage with at most one interval of staleness.

A worker's exposition runs to hundreds of lines (histograms, per-reason counters) of which the
gateway needs nine series: `read_series` looks only at the lines that name one, instead of
parsing every family, which costs the gateway's CPU on every scrape.

A worker that serves LoRA adapters says where they run in `vllm:lora_requests_info` (kvserve's
and vLLM's alike: the sample with the latest time is current, `read_adapter_state`); such a
worker is also asked its `/v1/models` each round, since adapters load and unload at runtime,
and the adapters it lists go to `on_adapters` (the request's `model` names one of them).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from kvserve.gateway.core.adapters import AdapterState
from kvserve.gateway.fleet.foreign_load import ForeignLoad
from kvserve.gateway.fleet.periodic import Periodic
from kvserve.gateway.fleet.upstream_http import UpstreamClient, UpstreamError
from kvserve.gateway.fleet.worker_pool import WorkerPool, WorkerState

log = logging.getLogger(__name__)

# series name (a counter's `_total` sample counts too) -> WorkerState field
_SERIES = {
    "vllm:num_requests_running": "num_running",
    "vllm:num_requests_waiting": "num_waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "kvserve:max_num_seqs": "batch_capacity",
    "vllm:prefix_cache_queries": "prefix_queries",
    "vllm:prefix_cache_hits": "prefix_hits",
    "vllm:request_success": "requests_finished",
    "sglang:num_running_reqs": "num_running",
    "sglang:num_queue_reqs": "num_waiting",
    "sglang:max_total_num_tokens": "kv_capacity_tokens",
}
CACHE_CONFIG_INFO = "vllm:cache_config_info"
"""kvserve's and vLLM's KV configuration, in labels: capacity = num_gpu_blocks x block_size."""
LORA_REQUESTS_INFO = "vllm:lora_requests_info"
"""Where a worker's LoRA adapters run and wait, in labels; its value is when that was current."""
_WANTED = (*_SERIES, CACHE_CONFIG_INFO)
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
SCRAPE_TIMEOUT_S = 2.0


def _capacity_from_info(labels: dict[str, str]) -> int | None:
    """Tokens of KV cache from a cache_config_info sample (None before the worker sized it:
    vLLM reports num_gpu_blocks="None" until then)."""
    blocks, block_size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
    if not (blocks.isdigit() and block_size.isdigit()):
        return None
    return int(blocks) * int(block_size) or None


def _sample(line: str) -> tuple[str, str, float] | None:
    """(name, label text, value) of one exposition line, None for a line that is not a sample
    (the value may be followed by a timestamp)."""
    brace = line.find("{")
    if brace >= 0:
        close = line.rfind("}")
        if close < brace:
            return None
        name, labels, rest = line[:brace], line[brace + 1:close], line[close + 1:]
    else:
        name, _, rest = line.partition(" ")
        labels = ""
    fields = rest.split()
    if not fields:
        return None
    try:
        return name.strip(), labels, float(fields[0])
    except ValueError:
        return None


def read_series(text: str) -> dict[str, float]:
    """The series the gateway reads, summed over label sets, by WorkerState field; the KV
    capacity from cache_config_info's labels (or SGLang's gauge). A series the text lacks is
    absent. Lines that name no wanted series are skipped without being parsed."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(_WANTED):
            continue
        sample = _sample(line)
        if sample is None:
            continue
        name, labels, value = sample
        if name == CACHE_CONFIG_INFO:
            capacity = _capacity_from_info(dict(_LABEL.findall(labels)))
            if capacity is not None:
                totals["kv_capacity_tokens"] = totals.get("kv_capacity_tokens", 0.0) + capacity
            continue
        field = _SERIES.get(name.removesuffix("_total"))
        if field is not None:
            totals[field] = totals.get(field, 0.0) + value
    return totals


def read_adapter_state(text: str) -> AdapterState | None:
    """The worker's adapters from its latest `vllm:lora_requests_info` sample (the largest
    value: the time its label set was last current; earlier sets stay exported). None when the
    text has none (the worker serves no adapters)."""
    if LORA_REQUESTS_INFO not in text:
        return None
    latest: tuple[float, str] | None = None
    for line in text.splitlines():
        if not line.startswith(LORA_REQUESTS_INFO):
            continue
        sample = _sample(line)
        if sample is None or sample[0] != LORA_REQUESTS_INFO:
            continue
        if latest is None or sample[2] >= latest[0]:
            latest = (sample[2], sample[1])
    if latest is None:
        return None
    return AdapterState.from_labels(dict(_LABEL.findall(latest[1])))


def listed_adapters(models: object) -> dict[str, str]:
    """Adapter name -> base model from a `/v1/models` answer: the entries with a `parent`, as
    vLLM and kvserve list adapters (anything else in the answer is ignored)."""
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list):
        return {}
    return {str(card["id"]): str(card["parent"]) for card in data
            if isinstance(card, dict) and card.get("id") and card.get("parent")}


def apply_metrics(worker: WorkerState, text: str) -> bool:
    """Update `worker` from a Prometheus text exposition (sums over label sets). Returns True
    when the worker restarted since the last scrape: its prefix-cache query counter went
    down, which a counter does only in a new process (whose cache starts empty)."""
    totals = read_series(text)
    worker.num_running = int(totals.get("num_running", worker.num_running))
    worker.num_waiting = int(totals.get("num_waiting", worker.num_waiting))
    if "batch_capacity" in totals:  # a kvserve worker says it
        worker.batch_capacity = int(totals["batch_capacity"])
        worker.capacity_declared = True
    elif worker.num_waiting > 0 or worker.batch_capacity > 0:
        # Full (some wait): what runs now is as much as it runs at once. Once a batch is
        # learned, a worker seen running more (admission lets a quarter more through) runs
        # at least that much: a batch seen while a burst's prefills queued behind the step's
        # token budget is not its limit, and must not stay one.
        worker.batch_capacity = max(worker.batch_capacity, worker.num_running)
    worker.kv_usage = totals.get("kv_usage", worker.kv_usage)
    worker.kv_capacity_tokens = int(totals.get("kv_capacity_tokens", worker.kv_capacity_tokens))
    queries = totals.get("prefix_queries", worker.prefix_queries)
    restarted = queries < worker.prefix_queries
    worker.prefix_queries = queries
    worker.prefix_hits = totals.get("prefix_hits", worker.prefix_hits)
    worker.requests_finished = totals.get("requests_finished")
    worker.adapters = read_adapter_state(text)
    return restarted


async def _get(client: UpstreamClient, url: str,
               headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
    """Status and body of a GET, both within SCRAPE_TIMEOUT_S."""
    async with asyncio.timeout(SCRAPE_TIMEOUT_S):
        response = await client.get(url, headers or {}, SCRAPE_TIMEOUT_S)
        return response.status_code, await response.aread()


class Scraper(Periodic):
    """Polls every worker; runs as one background task on the gateway's event loop. A worker
    seen restarted (`apply_metrics`) is reported to `on_restart(url)`: a routing policy's index
    of what it cached is stale from then on. A worker's KV capacity in tokens, when first seen
    and whenever it changes, goes to `on_capacity(url, tokens)`: how much a policy's index of it
    may hold. `on_scraped()` runs after each round (the fleet's capacity may have changed).
    Each scrape's requests that this gateway did not send go to `foreign` (`foreign_load.py`);
    when its verdict changes, to `on_shared(shared)`. The adapters a LoRA-serving worker lists
    go to `on_adapters(url, {name: base model})` (module doc)."""

    def __init__(self, pool: WorkerPool, client: UpstreamClient, interval_s: float = 1.0,
                 on_restart: Callable[[str], None] | None = None,
                 on_capacity: Callable[[str, int], None] | None = None,
                 on_scraped: Callable[[], None] | None = None,
                 foreign: ForeignLoad | None = None,
                 on_shared: Callable[[bool], None] | None = None,
                 metrics_key: str | None = None,
                 on_adapters: Callable[[str, dict[str, str]], None] | None = None):
        # workers started with --metrics-key answer /metrics only with it
        self.metrics_headers = {"authorization": f"Bearer {metrics_key}"} if metrics_key else {}
        self.foreign = foreign if foreign is not None else ForeignLoad()
        self.on_shared = on_shared
        # worker -> its last answered scrape, and its abandoned count at the one before
        self._last: dict[str, tuple[_Scrape, int]] = {}
        self.pool = pool
        self.client = client
        self.interval_s = interval_s
        self.on_restart = on_restart
        self.on_capacity = on_capacity
        self.on_scraped = on_scraped
        self.on_adapters = on_adapters

    async def scrape_once(self) -> None:
        shared = self.foreign.shared
        await asyncio.gather(*(self._scrape_isolated(w) for w in self.pool.workers.values()))
        if self.foreign.shared != shared and self.on_shared is not None:
            self.on_shared(self.foreign.shared)
        if self.on_scraped is not None:
            self.on_scraped()

    tick = scrape_once

    async def scrape_workers(self, urls: Sequence[str]) -> None:
        """Scrape these workers now (just discovered: their load and health are unknown), then
        `on_scraped()`."""
        await asyncio.gather(*(self._scrape(self.pool.workers[url]) for url in urls
                               if url in self.pool.workers))
        if self.on_scraped is not None:
            self.on_scraped()

    async def _scrape_isolated(self, worker: WorkerState) -> None:
        """`_scrape`, with a failure past the HTTP errors it handles (a page that breaks the
        parser, a callback that raises) logged and counted against this worker only: it is
        marked unhealthy until a scrape succeeds, and the others' scrapes go on."""
        try:
            await self._scrape(worker)
        except Exception as exc:
            log.exception("kvserve gateway: scraping %s failed", worker.url)
            self.pool.record_health(worker.url, False, time.monotonic(),
                                    f"scrape failed: {type(exc).__name__}: {exc}")

    def forget(self, url: str) -> None:
        """The worker left the fleet: drop what the last scrapes kept of it."""
        self._last.pop(url, None)

    async def _scrape(self, worker: WorkerState) -> None:
        now = time.monotonic()
        try:
            status, _ = await _get(self.client, f"{worker.url}/health")
            ok = status == 200
            self.pool.record_health(worker.url, ok, now,
                                    None if ok else f"/health answered {status}")
            if not ok:
                return
            sent = _Scrape(worker.in_flight, worker.dispatched, worker.abandoned)
            status, body = await _get(self.client, f"{worker.url}/metrics",
                                      self.metrics_headers)
        except TimeoutError:
            self.pool.record_health(worker.url, False, now,
                                    f"ReadTimeout: no answer in {SCRAPE_TIMEOUT_S}s")
            return
        except UpstreamError as exc:
            self.pool.record_health(worker.url, False, now, f"{type(exc).__name__}: {exc}")
            return
        if status != 200 or self.pool.workers.get(worker.url) is not worker:
            return  # no metrics, or the worker was forgotten while the scrape was out
        capacity = worker.kv_capacity_tokens
        restarted = apply_metrics(worker, body.decode("utf-8", "replace"))
        worker.last_scrape = now
        last, abandoned_before = self._last.get(worker.url, (None, sent.abandoned))
        scrape = replace(sent, finished=worker.requests_finished)
        self._last[worker.url] = (scrape, sent.abandoned if last is None else last.abandoned)
        # The gateway's own there: those open when the scrape went out, those sent while it
        # was out, and those it abandoned since the last scrape (the worker may not have
        # noticed the disconnect yet).
        running = self.foreign.record(
            now, worker.num_running + worker.num_waiting,
            sent.in_flight + worker.dispatched - sent.dispatched + worker.abandoned
            - (0 if last is None else last.abandoned))
        finished = 0
        if last is not None and not restarted:
            finished = self._foreign_finished(worker, now, last, abandoned_before)
        worker.foreign = max(running, finished)
        if restarted and self.on_restart is not None:
            self.on_restart(worker.url)
        if (worker.kv_capacity_tokens != capacity and worker.kv_capacity_tokens > 0
                and self.on_capacity is not None):
            self.on_capacity(worker.url, worker.kv_capacity_tokens)
        if worker.adapters is not None and self.on_adapters is not None:
            await self._list_adapters(worker)

    async def _list_adapters(self, worker: WorkerState) -> None:
        """Tell `on_adapters` what the worker's /v1/models lists now; an answer that cannot be
        read keeps what it listed before."""
        assert self.on_adapters is not None
        try:
            status, body = await _get(self.client, f"{worker.url}/v1/models")
        except (TimeoutError, UpstreamError):
            return
        if status != 200:
            return
        try:
            models = json.loads(body)
        except ValueError:
            return
        self.on_adapters(worker.url, listed_adapters(models))

    def _foreign_finished(self, worker: WorkerState, now: float, last: _Scrape,
                          abandoned_before: int) -> int:
        """Requests the worker finished since its `last` scrape that this gateway cannot have
        sent (`ForeignLoad.record_finished`); 0 without a counter to compare, or when it went
        down (the worker started again). Its own that the worker can have counted since: those
        in flight when the last scrape went out, those sent since, and those abandoned since
        the scrape before that (`abandoned_before`: a worker may count an abandoned request
        only once it notices)."""
        finished = worker.requests_finished
        if finished is None or last.finished is None or finished < last.finished:
            return 0
        own_at_most = (last.in_flight + worker.dispatched - last.dispatched
                       + worker.abandoned - abandoned_before)
        return self.foreign.record_finished(now, int(finished - last.finished), own_at_most)


@dataclass(frozen=True, slots=True)
class _Scrape:
    """This gateway's counts on a worker when a scrape of it went out (in flight, ever
    dispatched, ever abandoned), and the worker's finished-requests counter in its answer
    (None: not exported, or not read yet)."""

    in_flight: int
    dispatched: int
    abandoned: int
    finished: float | None = None
