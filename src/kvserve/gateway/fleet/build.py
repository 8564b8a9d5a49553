"""The routing core's live parts that every front end drives alike: the worker pool, the
policy, admission, the retry budget, the keys, the metrics and the background readers that keep
them fresh (scrapes, KV events). kvserve's proxy (`app.py`) and the Endpoint Picker
(`epp/`) both build theirs here, so a request is admitted, routed and counted the same way
whichever front end sees it."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx
from tokenizers import Tokenizer

from kvserve.gateway.core.adapters import AdapterCatalog
from kvserve.gateway.core.latency_limit import LatencyLimit
from kvserve.gateway.core.lifecycle import Dispatch, Hold
from kvserve.gateway.core.pipeline import (
    CapacityAware,
    Pipeline,
    RouteRequest,
    RoutingPolicy,
    make_policy,
)
from kvserve.gateway.core.prepare import Prepared
from kvserve.gateway.core.retry_budget import RetryBudget
from kvserve.gateway.core.seniority import Seniority, request_key
from kvserve.gateway.fleet.admission import Admission
from kvserve.gateway.fleet.discovery import DiscoveryCollector, DnsName, WorkerDiscovery
from kvserve.gateway.fleet.foreign_load import ForeignLoad
from kvserve.gateway.fleet.kv_event_metrics import KvEventCollector
from kvserve.gateway.fleet.metrics import GatewayMetrics
from kvserve.gateway.fleet.pool_ledger import PoolLedger
from kvserve.gateway.fleet.scraper import Scraper
from kvserve.gateway.fleet.settings import GatewaySettings
from kvserve.gateway.fleet.text_capacity import TextCapacity
from kvserve.gateway.fleet.token_source import ExactKeys, workers_model_dir
from kvserve.gateway.fleet.upstream_http import UpstreamClient
from kvserve.gateway.fleet.worker_pool import WorkerPool
from kvserve.gateway.fleet.zmq_events import ZmqEventFollower


def note_arrival(prepared: Prepared, path: str, raw: bytes, started: float,
                 capacity: TextCapacity | None, text_keyed: bool, seniority: Seniority | None,
                 metrics: GatewayMetrics) -> tuple[bytes, float | None]:
    """What every front end records of a prepared request before admission: a text-keyed
    completion prompt sampled for the characters-per-token ratio, and, with `seniority`, the
    request's resend key and when it was first asked for (its place in the queue)."""
    prompt = prepared.body.get("prompt")
    if capacity is not None and text_keyed and isinstance(prompt, str):
        capacity.sample(prompt)
    if seniority is None:
        return b"", None
    key = request_key(prepared.salt, path, raw)
    since = seniority.since(key, started)
    if since < started:
        metrics.resends.inc()
    return key, since


@dataclass(slots=True)
class Fleet:
    """One front end's routing state. `start()` before serving, `stop()` after;
    `on_scraped` callbacks run after each scrape round (health and capacity may have
    changed)."""

    settings: GatewaySettings
    pool: WorkerPool
    policy: Pipeline
    admission: Admission
    budget: RetryBudget
    keys: ExactKeys
    foreign: ForeignLoad
    metrics: GatewayMetrics
    client: httpx.AsyncClient
    upstream_client: UpstreamClient
    scraper: Scraper
    capacity: TextCapacity | None
    subscriber: ZmqEventFollower | None  # `precise`: the workers' KV events, over ZMQ
    discovery: WorkerDiscovery | None
    adapters: AdapterCatalog  # which LoRA adapter a request runs under (core/adapters.py)
    on_scraped: list[Callable[[], None]] = field(default_factory=list)
    ledger: PoolLedger = field(init=False)

    def __post_init__(self) -> None:
        self.ledger = PoolLedger(self.pool, self.metrics, self.settings.policy)

    def dispatch(self, route: RouteRequest, started: float, admitted: float,
                 deadline: float | None, hold: Hold | None) -> Dispatch:
        """An admitted request's lifecycle on this fleet's pool, policy and metrics."""
        return Dispatch(self.policy, self.ledger, route, started=started, admitted=admitted,
                        deadline=deadline, ttft_target_s=self.settings.ttft_target_s,
                        hold=hold)

    def scraped(self) -> None:
        self.admission.refresh()
        for callback in self.on_scraped:
            callback()

    async def learn(self, urls: list[str]) -> None:
        """What is read from workers once: the tokenizer for exact keys, and for text keys the
        one that measures characters per token (from the first that has it)."""
        await self.keys.resolve(self.client, urls)
        if (self.capacity is not None and self.keys.keyer is None
                and self.capacity.tokenizer is None):
            root = await workers_model_dir(self.client, urls)
            if root is not None:
                self.capacity.tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))

    async def discovered(self, urls: Sequence[str]) -> None:
        await self.scraper.scrape_workers(urls)
        await self.learn(list(urls))

    async def start(self) -> None:
        if self.discovery is not None:
            await self.discovery.refresh_once()  # its workers are scraped with the rest below
            self.discovery.on_added = self.discovered  # from now on, each as it appears
            self.discovery.start()
        await self.scraper.scrape_once()
        self.scraper.start()
        await self.learn(list(self.pool.workers))
        if self.subscriber is not None:  # decode workers are chosen by load, not prefix
            self.subscriber.start([url for url in self.pool.workers
                                   if url not in self.settings.decode_workers])
            await self.subscriber.wait_subscribed(5.0)

    async def stop(self) -> None:
        if self.subscriber is not None:
            await self.subscriber.stop()
        if self.discovery is not None:
            await self.discovery.stop()
        await self.scraper.stop()
        await self.client.aclose()
        await self.upstream_client.aclose()


async def served_model_id(client: httpx.AsyncClient, url: str) -> str | None:
    """The first model id the worker's /v1/models lists (None if it cannot be read)."""
    try:
        answer = await client.get(f"{url}/v1/models", timeout=5.0)
        return str(answer.json()["data"][0]["id"]) if answer.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None


def build_fleet(settings: GatewaySettings,
                on_shared: Callable[[bool, RoutingPolicy, ForeignLoad], None] | None = None
                ) -> Fleet:
    """The parts `settings` ask for; raises ValueError saying which flags disagree."""
    if settings.is_discovering and settings.is_disaggregated:
        raise ValueError("--worker-dns and --workers-file discover unified workers; "
                         "disaggregated mode takes its --prefill-worker and --decode-worker "
                         "URLs as given: drop one or the other")
    pool = WorkerPool(list(settings.workers), allow_empty=settings.is_discovering)
    discovery = (WorkerDiscovery(pool, settings.workers,
                                 [DnsName.from_spec(spec) for spec in settings.worker_dns],
                                 settings.workers_file, settings.discovery_interval_s)
                 if settings.is_discovering else None)
    num_workers = len(discovery.fleet()) if discovery is not None else len(settings.workers)
    policy = make_policy(settings.policy, **dict(settings.policy_options))
    event_sources = dict(settings.worker_kv_events)
    if ((event_sources or settings.kv_events_default is not None)
            and policy.event_index is None):
        raise ValueError("--worker-kv-events feeds --policy precise's index; add --policy "
                         "precise or drop --worker-kv-events")
    unknown = sorted(set(event_sources) - set(settings.workers))
    if unknown and not settings.is_discovering:
        raise ValueError(f"--worker-kv-events names {', '.join(unknown)}, which is not a "
                         "--worker; give the same URL to both")
    latency = (LatencyLimit(settings.max_in_flight,
                            floor=max(1, min(num_workers, settings.max_in_flight)))
               if settings.latency_limit else None)
    admission = Admission(settings.max_in_flight, settings.max_queued, settings.queue_timeout_s,
                          max_queue_wait_s=settings.max_queue_wait_s,
                          fleet_slots=lambda: pool.fleet_slots(time.monotonic()),
                          latency=latency,
                          latency_applies=lambda: (settings.ttft_target_s is not None
                                                   or not pool.all_declared(time.monotonic())),
                          retry_budget=RetryBudget(ratio=settings.retry_ratio))
    budget = admission.retry_budget
    keys = ExactKeys(settings.tokenizer, settings.block_size, settings.policy == "precise")
    foreign = ForeignLoad()
    metrics = GatewayMetrics(pool, admission, budget, keys, foreign, settings.policy,
                             policy.replica_safe)
    client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None,
                                                   max_keepalive_connections=256))
    upstream_client = UpstreamClient()
    # A restarted worker caches nothing: the policy forgets what its index said it held.
    # An index that cannot see evictions holds no more than the worker's KV cache can.
    capacity = TextCapacity(policy) if isinstance(policy, CapacityAware) else None
    adapters = AdapterCatalog(dict(settings.tenant_adapters))
    fleet_ref: list[Fleet] = []
    scraper = Scraper(pool, upstream_client, settings.scrape_interval_s,
                      on_restart=policy.remove_worker,
                      on_capacity=capacity.worker_capacity if capacity is not None else None,
                      on_scraped=lambda: fleet_ref[0].scraped(), foreign=foreign,
                      on_shared=(None if on_shared is None
                                 else lambda shared: on_shared(shared, policy, foreign)),
                      metrics_key=settings.metrics_key, on_adapters=adapters.set_listed)
    subscriber = None
    if policy.event_index is not None:
        subscriber = ZmqEventFollower(event_sources, policy.event_index,
                                      lambda url: served_model_id(client, url),
                                      block_size=settings.block_size,
                                      default=settings.kv_events_default,
                                      adapters=adapters)
        metrics.registry.register(KvEventCollector(subscriber))
    # Whatever keeps state per worker follows the fleet as workers come and go.
    pool.on_forgotten += [policy.remove_worker, metrics.forget_worker, scraper.forget,
                          adapters.forget_worker]
    if capacity is not None:
        pool.on_forgotten.append(capacity.forget)
    if subscriber is not None:
        pool.on_added.append(subscriber.follow)
        pool.on_forgotten.append(subscriber.unfollow)
    if discovery is not None:
        metrics.registry.register(DiscoveryCollector(discovery))
    fleet = Fleet(settings, pool, policy, admission, budget, keys, foreign, metrics, client,
                  upstream_client, scraper, capacity, subscriber, discovery, adapters)
    fleet_ref.append(fleet)
    return fleet
