"""The gateway's HTTP face: OpenAI routes proxied to the chosen worker (`endpoint`, on
plain ASGI), plus /v1/models, /health, /metrics and /workers (FastAPI). Stateless across
replicas: the routing policy needs no shared state."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvserve.gateway.core.lifecycle import Router
from kvserve.gateway.core.pipeline import DisaggregatedRouter, RoutingPolicy, make_policy
from kvserve.gateway.core.seniority import Seniority
from kvserve.gateway.core.tenancy import has_bearer
from kvserve.gateway.fleet.build import build_fleet
from kvserve.gateway.fleet.foreign_load import ForeignLoad
from kvserve.gateway.fleet.settings import GatewaySettings
from kvserve.gateway.proxy.endpoint import ProxyEndpoint, Receive, Scope, Send
from kvserve.gateway.proxy.forward import Forwarder
from kvserve.wire.http import PROXIED_PATHS, error_body

__all__ = ["GatewayApp", "GatewaySettings", "create_gateway"]

log = logging.getLogger(__name__)


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


def create_gateway(settings: GatewaySettings) -> GatewayApp:
    fleet = build_fleet(settings, on_shared=_on_shared)
    pool, policy, metrics, client = fleet.pool, fleet.policy, fleet.metrics, fleet.client
    capacity, keys, foreign, subscriber = (fleet.capacity, fleet.keys, fleet.foreign,
                                           fleet.subscriber)
    discovery = fleet.discovery
    disagg = None
    router: Router = policy
    if settings.is_disaggregated:
        if not settings.admin_key:
            raise ValueError("disaggregated mode needs --admin-key (the workers' admin key): "
                             "decode workers honour the prefill worker's URL only with it")
        disagg = DisaggregatedRouter(policy, make_policy("least_load"),
                                     settings.prefill_workers, settings.decode_workers)
        if set(settings.workers) != disagg.prefill_ids | disagg.decode_ids:
            raise ValueError("in disaggregated mode every worker is a --prefill-worker or a "
                             "--decode-worker; drop the plain --worker URLs")
        for url, worker in pool.workers.items():
            worker.role = disagg.role_of(url)
        router = disagg
    forwarder = Forwarder(pool, router, fleet.upstream_client, fleet.budget, metrics,
                          settings.policy, settings.request_timeout_s, settings.admin_key)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await fleet.start()
        yield
        await fleet.stop()

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
             "kv_events": subscriber.state(w.url) if subscriber is not None else None}
            for w in pool.workers.values()]}

    proxy = ProxyEndpoint(forwarder, fleet.admission, metrics, settings.tenancy, keys, capacity,
                          settings.max_body_bytes, settings.ttft_target_s,
                          Seniority() if settings.seniority else None,
                          settings.worker_api_key, settings.trusted_salt_key, fleet.adapters)
    return GatewayApp(proxy, app)

