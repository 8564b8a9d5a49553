"""The gateway's HTTP face: OpenAI routes proxied to the chosen worker (`proxy_endpoint`, on
plain ASGI), plus /v1/models, /health, /metrics and /workers (FastAPI). Stateless across
replicas: the routing policy needs no shared state."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from tokenizers import Tokenizer

from kvserve.gateway.admission import Admission
from kvserve.gateway.discovery import (
    DEFAULT_INTERVAL_S,
    DiscoveryCollector,
    DnsName,
    WorkerDiscovery,
)
from kvserve.gateway.foreign_load import ForeignLoad
from kvserve.gateway.forward import Forwarder
from kvserve.gateway.kv_events import DEFAULT_MIN_POLL_INTERVAL_S, EventFollower
from kvserve.gateway.latency_limit import LatencyLimit
from kvserve.gateway.metrics import GatewayMetrics
from kvserve.gateway.policies import (
    CapacityAware,
    DisaggregatedRouter,
    PrecisePolicy,
    RoutingPolicy,
    make_policy,
)
from kvserve.gateway.proxy_endpoint import (
    PROXIED_PATHS,
    ProxyEndpoint,
    Receive,
    Scope,
    Send,
    error_body,
)
from kvserve.gateway.queue_wait import DEFAULT_MAX_QUEUE_WAIT_S
from kvserve.gateway.retry_budget import RetryBudget
from kvserve.gateway.scraper import Scraper
from kvserve.gateway.seniority import Seniority
from kvserve.gateway.tenancy import Tenancy, generated_secret, has_bearer
from kvserve.gateway.text_capacity import TextCapacity
from kvserve.gateway.token_keys import ExactKeys, workers_model_dir
from kvserve.gateway.upstream_http import UpstreamClient
from kvserve.gateway.worker_pool import WorkerPool
from kvserve.gateway.zmq_events import EventSource, ZmqEventFollower

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """`max_in_flight`: requests open upstream at once (fleet-wide; less once the workers'
    batch capacity is known, `admission.py`); beyond it up to `max_queued` wait
    `queue_timeout_s` for a slot (a client that says its timeout: while it can still be
    answered in time, at most `max_queue_wait_s`), then get 429 + Retry-After."""

    workers: tuple[str, ...]
    policy: str = "prefix_hash"
    policy_options: tuple[tuple[str, Any], ...] = ()  # make_policy keyword options
    max_in_flight: int = 256
    max_queued: int = 512
    queue_timeout_s: float = 1.0
    max_queue_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S
    request_timeout_s: float | None = 600.0
    retry_ratio: float = 0.1
    scrape_interval_s: float = 1.0
    max_body_bytes: int = 8 * 1024 * 1024
    latency_limit: bool = True  # the AIMD limit from late first bytes (`latency_limit.py`)
    seniority: bool = True  # a resend queues in its first send's place (`seniority.py`)
    ttft_target_s: float | None = None  # a first byte later than this is late for that limit
    tenancy: Tenancy = field(default_factory=lambda: Tenancy(generated_secret()))
    worker_api_key: str | None = None  # sent to workers when the gateway checks keys itself
    trusted_salt_key: str | None = None  # sent with salted requests (X-KVServe-Salt-Key)
    metrics_key: str | None = None  # guards this /metrics; sent to the workers' /metrics
    tokenizer: str | None = None  # the workers' tokenizer, for exact keys (`precise`)
    block_size: int = 16  # the workers' KV block size, for exact keys
    events_interval_s: float = 0.25  # `precise`: pause after a failed read of KV events
    events_min_interval_s: float = DEFAULT_MIN_POLL_INTERVAL_S  # between reads of one worker
    admin_key: str | None = None  # sent to the workers' /kv/events and to decode workers
    # `precise`: workers followed over ZMQ (vLLM's KV-event wire); the others' /kv/events is
    # long-polled.
    worker_kv_events: tuple[tuple[str, EventSource], ...] = ()
    # Disaggregated mode (both non-empty): prompts prefilled on `prefill_workers` (by
    # `policy`), decoded on `decode_workers` (by least load); `workers` is then their union.
    prefill_workers: tuple[str, ...] = ()
    decode_workers: tuple[str, ...] = ()
    # Discovery (`discovery/`): `workers` plus every address of these NAME:PORTs and the URLs
    # of this file, followed every `discovery_interval_s` without a restart.
    worker_dns: tuple[str, ...] = ()
    workers_file: str | None = None
    discovery_interval_s: float = DEFAULT_INTERVAL_S

    @property
    def is_discovering(self) -> bool:
        return bool(self.worker_dns or self.workers_file)

    @property
    def is_disaggregated(self) -> bool:
        return bool(self.prefill_workers or self.decode_workers)


class GatewayApp:
    """The gateway's ASGI application: the proxied routes straight to `proxy`, everything else
    (lifespan included) to `app`."""

    def __init__(self, proxy: ProxyEndpoint, app: FastAPI) -> None:
        self.proxy = proxy
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in PROXIED_PATHS:
            await self.proxy(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def _error(status: int, message: str, err_type: str = "invalid_request_error") -> Response:
    return Response(error_body(status, message, err_type), status, media_type="application/json")


def _on_shared(shared: bool, policy: RoutingPolicy, foreign: ForeignLoad) -> None:
    """The gateway's verdict on whether its workers serve other routers' requests changed: say
    what it means for this policy."""
    if not shared:
        log.info("kvserve gateway: the workers no longer serve requests this gateway did not "
                 "send")
        return
    seen = (f"the workers serve requests this gateway did not send ({foreign.share:.0%} of "
            f"the requests they reported over the last minute): other gateway replicas, or "
            f"clients that bypass the gateway")
    if policy.replica_safe:
        log.info("kvserve gateway: %s; %s routes alike on every replica", seen, policy.name)
    else:
        log.warning("kvserve gateway: %s. This %s places a new prefix by what this gateway "
                    "alone has routed, so replicas place tenants apart and the fleet's prefix "
                    "hit rate falls (docs/operations.md, 'Scaling the gateway horizontally'): "
                    "run every replica with the policy's defaults (--policy cache_aware), or "
                    "--policy precise or prefix_hash", seen, policy.name)


async def served_model_id(client: httpx.AsyncClient, url: str) -> str | None:
    """The first model id the worker's /v1/models lists (None if it cannot be read)."""
    try:
        answer = await client.get(f"{url}/v1/models", timeout=5.0)
        return str(answer.json()["data"][0]["id"]) if answer.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None


def create_gateway(settings: GatewaySettings) -> GatewayApp:
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
    if event_sources and not isinstance(policy, PrecisePolicy):
        raise ValueError("--worker-kv-events feeds --policy precise's index; add --policy "
                         "precise or drop --worker-kv-events")
    unknown = sorted(set(event_sources) - set(settings.workers))
    if unknown:
        raise ValueError(f"--worker-kv-events names {', '.join(unknown)}, which is not a "
                         "--worker; give the same URL to both")
    disagg = None
    if settings.is_disaggregated:
        disagg = DisaggregatedRouter(policy, make_policy("least_load"),
                                     settings.prefill_workers, settings.decode_workers)
        if set(settings.workers) != disagg.prefill_ids | disagg.decode_ids:
            raise ValueError("in disaggregated mode every worker is a --prefill-worker or a "
                             "--decode-worker; drop the plain --worker URLs")
        for url, worker in pool.workers.items():
            worker.role = disagg.role_of(url)
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
    forwarder = Forwarder(pool, policy, upstream_client, budget, metrics, settings.policy,
                          settings.request_timeout_s, disagg, settings.admin_key)
    # A restarted worker caches nothing: the policy forgets what its index said it held.
    # An index that cannot see evictions holds no more than the worker's KV cache can.
    capacity = TextCapacity(policy) if isinstance(policy, CapacityAware) else None
    scraper = Scraper(pool, upstream_client, settings.scrape_interval_s,
                      on_restart=policy.remove_worker,
                      on_capacity=capacity.worker_capacity if capacity is not None else None,
                      on_scraped=admission.refresh, foreign=foreign,
                      on_shared=lambda shared: _on_shared(shared, policy, foreign),
                      metrics_key=settings.metrics_key)
    follower = (EventFollower(pool, policy, upstream_client, settings.events_interval_s,
                              settings.admin_key,
                              min_interval_s=settings.events_min_interval_s)
                if isinstance(policy, PrecisePolicy) else None)
    subscriber = None
    if isinstance(policy, PrecisePolicy) and follower is not None and event_sources:
        follower.unsupported.update(event_sources)  # followed over ZMQ instead
        subscriber = ZmqEventFollower(event_sources, policy,
                                      lambda url: served_model_id(client, url),
                                      block_size=settings.block_size)
    # Whatever keeps state per worker follows the fleet as workers come and go.
    pool.on_forgotten += [policy.remove_worker, metrics.forget_worker, scraper.forget]
    if capacity is not None:
        pool.on_forgotten.append(capacity.forget)
    if follower is not None:
        pool.on_added.append(follower.follow)
        pool.on_forgotten.append(follower.unfollow)

    async def learn(urls: list[str]) -> None:
        """What the gateway reads from workers once: the tokenizer for exact keys, and for
        text keys the one that measures characters per token (from the first that has it)."""
        await keys.resolve(client, urls)
        if capacity is not None and keys.keyer is None and capacity.tokenizer is None:
            root = await workers_model_dir(client, urls)
            if root is not None:
                capacity.tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))

    async def discovered(urls: Sequence[str]) -> None:
        await scraper.scrape_workers(urls)
        await learn(list(urls))

    if discovery is not None:
        metrics.registry.register(DiscoveryCollector(discovery))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if discovery is not None:
            await discovery.refresh_once()  # its workers are scraped with the rest just below
            discovery.on_added = discovered  # from now on, each as it appears
            discovery.start()
        await scraper.scrape_once()
        scraper.start()
        await learn(list(pool.workers))
        if subscriber is not None:
            subscriber.start()
            await subscriber.wait_subscribed(5.0)
        if follower is not None:
            await follower.poll_once()
            follower.start()
        yield
        if follower is not None:
            await follower.stop()
        if subscriber is not None:
            await subscriber.stop()
        if discovery is not None:
            await discovery.stop()
        await scraper.stop()
        await client.aclose()
        await upstream_client.aclose()

    app = FastAPI(title="kvserve gateway", lifespan=lifespan)

    @app.get("/v1/models")
    async def models() -> Response:
        for worker in list(pool.workers.values()):  # the fleet may change while we wait
            if worker.healthy and not worker.draining:
                try:
                    answer = await client.get(f"{worker.url}/v1/models", timeout=5.0)
                except httpx.HTTPError:
                    continue
                return Response(answer.content, answer.status_code,
                                media_type="application/json")
        return _error(503, "no healthy worker", "service_unavailable")

    @app.get("/health")
    async def health() -> Response:
        now = time.monotonic()
        healthy = sum(1 for v in pool.views(now) if v.healthy)
        status = 200 if healthy else 503
        draining = sum(1 for w in pool.workers.values() if w.draining)
        return JSONResponse({"status": "ok" if healthy else "no healthy worker",
                             "healthy_workers": healthy, "workers": len(pool.workers) - draining,
                             "draining_workers": draining}, status)

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        if settings.metrics_key is not None and not has_bearer(request.headers,
                                                                settings.metrics_key):
            return _error(401, "/metrics needs the gateway's --metrics-key: send "
                          "'Authorization: Bearer <key>'", "authentication_error")
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/workers")
    async def workers() -> dict[str, Any]:
        now = time.monotonic()
        text_keys = None
        if capacity is not None and keys.keyer is None:
            text_keys = {"chars_per_token": capacity.chars_per_token,
                         "tokenized_samples": capacity.samples,
                         "tokenizer": capacity.tokenizer is not None}
        return {"policy": settings.policy, "policy_options": dict(settings.policy_options),
                "mode": "disaggregated" if disagg is not None else "unified",
                "shared_workers": {"detected": foreign.shared, "foreign_share": foreign.share,
                                   "replica_safe": policy.replica_safe},
                "text_keys": text_keys,
                "discovery": ({"discovered": discovery.discovered, "errors": discovery.errors,
                               "interval_s": discovery.interval_s}
                              if discovery is not None else None),
                "workers": [
            {"url": w.url, "role": w.role, "healthy": w.view(now).healthy,
             "draining": w.draining,
             "in_flight": w.in_flight, "prefill_backlog_tokens": w.prefill_backlog_tokens,
             "num_running": w.num_running, "num_waiting": w.num_waiting,
             "foreign_requests": w.foreign,
             "kv_usage": w.kv_usage, "kv_capacity_tokens": w.kv_capacity_tokens or None,
             "prefix_hit_rate": (w.prefix_hits / w.prefix_queries
                                                         if w.prefix_queries else None),
             "requests": w.requests, "failures": w.failures, "backpressure": w.backpressure,
             "ejected_for_s": max(0.0, w.ejected_until - now), "last_error": w.last_error,
             "kv_events": (subscriber.state(w.url) if subscriber is not None
                           and w.url in event_sources else None)}
            for w in pool.workers.values()]}

    proxy = ProxyEndpoint(forwarder, admission, metrics, settings.tenancy, keys, capacity,
                          settings.max_body_bytes, settings.ttft_target_s,
                          Seniority() if settings.seniority else None,
                          settings.worker_api_key, settings.trusted_salt_key)
    return GatewayApp(proxy, app)

