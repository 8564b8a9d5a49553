"""The gateway's HTTP face: OpenAI routes proxied to the chosen worker, plus /health, /metrics
and /workers. Stateless across replicas: the routing policy needs no shared state."""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from tokenizers import Tokenizer

from kvserve.gateway.admission import Admission, Saturated
from kvserve.gateway.forward import Forwarder, NoWorkerAvailable, Upstream
from kvserve.gateway.kv_events import DEFAULT_MIN_POLL_INTERVAL_S, EventFollower
from kvserve.gateway.metrics import GatewayMetrics
from kvserve.gateway.policies import (
    CapacityAware,
    DisaggregatedRouter,
    NoHealthyWorker,
    PrecisePolicy,
    make_policy,
)
from kvserve.gateway.retry_budget import RetryBudget
from kvserve.gateway.route_key import route_request_for
from kvserve.gateway.scraper import Scraper
from kvserve.gateway.tenancy import Tenancy
from kvserve.gateway.text_capacity import TextCapacity
from kvserve.gateway.token_keys import ExactKeys, workers_model_dir
from kvserve.gateway.upstream_http import UpstreamClient, UpstreamError
from kvserve.gateway.worker_pool import WorkerPool

FORWARDED_HEADERS = ("x-request-id", "authorization")


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """`max_in_flight`: requests open upstream at once (fleet-wide); beyond it up to
    `max_queued` wait `queue_timeout_s` for a slot, then get 429 + Retry-After."""

    workers: tuple[str, ...]
    policy: str = "prefix_hash"
    policy_options: tuple[tuple[str, Any], ...] = ()  # make_policy keyword options
    max_in_flight: int = 256
    max_queued: int = 512
    queue_timeout_s: float = 5.0
    request_timeout_s: float | None = 600.0
    retry_ratio: float = 0.1
    scrape_interval_s: float = 1.0
    max_body_bytes: int = 8 * 1024 * 1024
    tenancy: Tenancy = field(default_factory=Tenancy)
    tokenizer: str | None = None  # the workers' tokenizer, for exact keys (`precise`)
    block_size: int = 16  # the workers' KV block size, for exact keys
    events_interval_s: float = 0.25  # `precise`: pause after a failed read of KV events
    events_min_interval_s: float = DEFAULT_MIN_POLL_INTERVAL_S  # between reads of one worker
    admin_key: str | None = None  # sent to the workers' /kv/events and to decode workers
    # Disaggregated mode (both non-empty): prompts prefilled on `prefill_workers` (by
    # `policy`), decoded on `decode_workers` (by least load); `workers` is then their union.
    prefill_workers: tuple[str, ...] = ()
    decode_workers: tuple[str, ...] = ()

    @property
    def is_disaggregated(self) -> bool:
        return bool(self.prefill_workers or self.decode_workers)


def _error(status: int, message: str, err_type: str = "invalid_request_error",
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": err_type, "param": None,
                                   "code": status}}, status_code=status, headers=headers)


def _parse_json(raw: bytes) -> Any:
    """Strict JSON: NaN, Infinity and overflowing floats are refused here (the gateway could not
    forward them as JSON), and so is nesting too deep to parse; each raises ValueError."""
    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(f"number {text} is out of range")
        return value

    def constant(name: str) -> float:
        raise ValueError(f"{name} is not valid JSON")

    try:
        return json.loads(raw, parse_float=finite, parse_constant=constant)
    except RecursionError:
        raise ValueError("the JSON is nested too deeply") from None


def create_gateway(settings: GatewaySettings) -> FastAPI:
    pool = WorkerPool(list(settings.workers))
    policy = make_policy(settings.policy, **dict(settings.policy_options))
    disagg = None
    if settings.is_disaggregated:
        disagg = DisaggregatedRouter(policy, make_policy("least_load"),
                                     settings.prefill_workers, settings.decode_workers)
        if set(settings.workers) != disagg.prefill_ids | disagg.decode_ids:
            raise ValueError("in disaggregated mode every worker is a --prefill-worker or a "
                             "--decode-worker; drop the plain --worker URLs")
        for url, worker in pool.workers.items():
            worker.role = disagg.role_of(url)
    admission = Admission(settings.max_in_flight, settings.max_queued, settings.queue_timeout_s)
    budget = RetryBudget(ratio=settings.retry_ratio)
    keys = ExactKeys(settings.tokenizer, settings.block_size, settings.policy == "precise")
    metrics = GatewayMetrics(pool, admission, budget, keys)
    client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None,
                                                   max_keepalive_connections=256))
    upstream_client = UpstreamClient()
    forwarder = Forwarder(pool, policy, upstream_client, budget, metrics, settings.policy,
                          settings.request_timeout_s, disagg, settings.admin_key)
    # A restarted worker caches nothing: the policy forgets what its index said it held.
    # An index that cannot see evictions holds no more than the worker's KV cache can.
    capacity = TextCapacity(policy) if isinstance(policy, CapacityAware) else None
    scraper = Scraper(pool, client, settings.scrape_interval_s, on_restart=policy.remove_worker,
                      on_capacity=capacity.worker_capacity if capacity is not None else None)
    follower = (EventFollower(pool, policy, upstream_client, settings.events_interval_s,
                              settings.admin_key,
                              min_interval_s=settings.events_min_interval_s)
                if isinstance(policy, PrecisePolicy) else None)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await scraper.scrape_once()
        scraper.start()
        await keys.resolve(client, list(settings.workers))
        if capacity is not None and keys.keyer is None:  # text keys: measure chars per token
            root = await workers_model_dir(client, list(settings.workers))
            if root is not None:
                capacity.tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        if follower is not None:
            await follower.poll_once()
            follower.start()
        yield
        if follower is not None:
            await follower.stop()
        await scraper.stop()
        await client.aclose()
        await upstream_client.aclose()

    app = FastAPI(title="kvserve gateway", lifespan=lifespan)

    async def proxy(request: Request, path: str) -> Response:
        response = await _proxy(request, path)
        request_id = request.headers.get("x-request-id")
        if request_id:  # echoed, as the workers do, so callers can correlate
            response.headers["x-request-id"] = request_id
        return response

    async def _proxy(request: Request, path: str) -> Response:
        started = time.monotonic()
        raw = await request.body()
        if len(raw) > settings.max_body_bytes:
            return _error(413, f"request body exceeds {settings.max_body_bytes} bytes")
        try:
            body = _parse_json(raw)
        except ValueError as exc:  # UnicodeDecodeError included
            return _error(400, f"the request body is not valid JSON ({exc}): send a JSON object "
                          "(UTF-8)")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        _, salt = settings.tenancy.resolve(request.headers)
        body.pop("cache_salt", None)  # never trust a client's salt
        if salt is not None:
            body["cache_salt"] = salt
        try:
            route = route_request_for(path, body, salt, keys.keyer)
        except ValueError as exc:
            return _error(400, str(exc))
        if capacity is not None and keys.keyer is None and isinstance(body.get("prompt"), str):
            capacity.sample(body["prompt"])
        headers = {k: v for k, v in request.headers.items() if k in FORWARDED_HEADERS}
        try:
            await admission.acquire()
        except Saturated as exc:
            metrics.rejections.labels(exc.reason).inc()
            return _error(429, f"the fleet is saturated ({exc.reason}); retry after "
                          f"{exc.retry_after_s}s", "rate_limit_error",
                          {"Retry-After": str(exc.retry_after_s)})
        try:
            upstream = await forwarder.open(path, body, headers, route, started)
        except NoHealthyWorker as exc:
            admission.release()
            metrics.rejections.labels("no_healthy_worker").inc()
            return _error(503, f"no healthy worker: {exc}", "service_unavailable",
                          {"Retry-After": "1"})
        except NoWorkerAvailable as exc:
            admission.release()
            metrics.rejections.labels(f"upstream_{exc.status}").inc()
            if exc.body is not None:
                extra = {"Retry-After": exc.retry_after} if exc.retry_after else None
                return Response(exc.body, exc.status, headers=extra,
                                media_type="application/json")
            return _error(503, str(exc), "service_unavailable", {"Retry-After": "1"})
        except BaseException:
            admission.release()
            raise
        content_type = upstream.response.headers.get("content-type", "application/json")
        if not content_type.startswith("text/event-stream"):
            try:
                content = await upstream.read()
            except UpstreamError as exc:
                return _error(502, f"worker {upstream.worker_url} failed mid-response: "
                              f"{type(exc).__name__}", "upstream_error")
            finally:
                admission.release()
            return Response(content, upstream.response.status_code, media_type=content_type)
        return StreamingResponse(_relay(upstream, admission), upstream.response.status_code,
                                 media_type=content_type)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        for worker in pool.workers.values():
            if worker.healthy:
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
        return JSONResponse({"status": "ok" if healthy else "no healthy worker",
                             "healthy_workers": healthy, "workers": len(pool.workers)}, status)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/workers")
    async def workers() -> dict[str, Any]:
        now = time.monotonic()
        text_keys = None
        if capacity is not None and keys.keyer is None:
            text_keys = {"chars_per_token": capacity.chars_per_token,
                         "tokenized_samples": capacity.samples,
                         "tokenizer": capacity.tokenizer is not None}
        return {"policy": settings.policy,
                "mode": "disaggregated" if disagg is not None else "unified",
                "text_keys": text_keys, "workers": [
            {"url": w.url, "role": w.role, "healthy": w.view(now).healthy,
             "in_flight": w.in_flight, "prefill_backlog_tokens": w.prefill_backlog_tokens,
             "num_running": w.num_running, "num_waiting": w.num_waiting,
             "kv_usage": w.kv_usage, "kv_capacity_tokens": w.kv_capacity_tokens or None,
             "prefix_hit_rate": (w.prefix_hits / w.prefix_queries
                                                         if w.prefix_queries else None),
             "requests": w.requests, "failures": w.failures, "backpressure": w.backpressure,
             "ejected_for_s": max(0.0, w.ejected_until - now), "last_error": w.last_error}
            for w in pool.workers.values()]}

    return app


async def _relay(upstream: Upstream, admission: Admission) -> AsyncIterator[bytes]:
    """Pass an SSE stream through. If the worker dies mid-stream the client gets an error event
    and the end marker, never a hang; if the client leaves, the upstream is closed."""
    try:
        async for chunk in upstream.iter_raw():
            yield chunk
    except UpstreamError as exc:
        error = {"error": {"message": f"worker {upstream.worker_url} failed mid-stream "
                           f"({type(exc).__name__}); retry the request", "type": "upstream_error",
                           "param": None, "code": 502}}
        yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
    finally:
        await upstream.close()
        admission.release()
