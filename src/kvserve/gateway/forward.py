"""Sending one request upstream: pick a worker, open the response, fail over before first byte.

A retry goes to the next worker in the policy's ranked order, only while nothing has reached the
client, and only within the retry budget. A worker's 429/503 is backpressure (spill to the next
worker), never a failure; a connection error counts toward ejecting the worker.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from kvserve.client_timeout import TIMEOUT_HEADER, format_timeout
from kvserve.gateway.metrics import GatewayMetrics
from kvserve.gateway.policies import (
    DisaggregatedRouter,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
)
from kvserve.gateway.retry_budget import RetryBudget
from kvserve.gateway.upstream_http import UpstreamClient, UpstreamError, UpstreamResponse
from kvserve.gateway.worker_pool import WorkerPool

BACKPRESSURE = (429, 503)
PREDICTED_CACHED_HEADER = "x-kvserve-predicted-cached-tokens"
"""On each answer the proxy relays: the prompt tokens the policy expected the worker to have
cached (`Upstream.predicted_cached_tokens`), so a client can check the routing's prediction
against the worker's `usage.prompt_tokens_details.cached_tokens`. It says only what the caller's
own tenant caches: tenant salts keep tenants' blocks apart."""
PREFILL_URL_HEADER = "X-KVServe-Prefill-Url"  # read by a decode worker, with the admin key
ADMIN_KEY_HEADER = "X-KVServe-Admin-Key"


class NoWorkerAvailable(Exception):
    """Every candidate failed or pushed back. Carries the last worker answer, if any."""

    def __init__(self, message: str, status: int = 503, body: bytes | None = None,
                 retry_after: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body
        self.retry_after = retry_after


@dataclass(slots=True)
class Upstream:
    """An open upstream response; `close` must be called exactly once (it is idempotent)."""

    worker_url: str
    response: UpstreamResponse
    decision: RouteDecision
    pool: WorkerPool
    closed: bool = False
    ended: bool = False  # the whole body was read: the worker is done with the request
    # Prompt tokens the policy expected this worker to serve from its cache: its matched
    # prefix blocks in the key's tokens (approximate for text keys), at most the prompt. None
    # where it made no prediction for the worker that answered (a failover, disaggregated).
    predicted_cached_tokens: int | None = None

    async def read(self) -> bytes:
        try:
            body = await self.response.aread()
            self.ended = True
            return body
        finally:
            await self.close()

    async def iter_raw(self) -> AsyncGenerator[bytes, None]:
        """The body as it arrives; closing early closes the upstream connection, which the
        worker sees as a disconnect (and aborts the request, freeing its blocks)."""
        try:
            async for chunk in self.response.aiter_raw():
                yield chunk
            self.ended = True
        finally:
            await self.close()

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            worker = self.pool.get(self.worker_url)
            if not self.ended:  # the worker may count it until it sees the disconnect
                worker.abandoned += 1
            self.pool.end_request(worker)  # a draining worker's last one lets it go
            await self.response.aclose()


class Forwarder:
    """Routes with `policy` over `pool` and opens upstream responses with `client`. With
    `disagg`, the request goes to a decode worker (by load) with a header naming the prefill
    worker (by prefix) it pulls the prompt's KV from, authenticated with `admin_key`."""

    def __init__(self, pool: WorkerPool, policy: RoutingPolicy, client: UpstreamClient,
                 budget: RetryBudget, metrics: GatewayMetrics, policy_name: str,
                 request_timeout_s: float | None, disagg: DisaggregatedRouter | None = None,
                 admin_key: str | None = None) -> None:
        if disagg is not None and not admin_key:
            raise ValueError("disaggregated mode needs --admin-key (the workers' admin key): "
                             "decode workers honour the prefill worker's URL only with it")
        self.disagg = disagg
        self.admin_key = admin_key
        self.pool = pool
        self.policy = policy
        self.client = client
        self.budget = budget
        self.metrics = metrics
        self.policy_name = policy_name
        self.read_timeout_s = request_timeout_s  # per read, as httpx's read timeout

    async def open(self, path: str, body: dict[str, Any], headers: dict[str, str],
                   route: RouteRequest, started: float,
                   deadline: float | None = None) -> Upstream:
        """The first worker (in ranked order) that accepts the request. With `deadline` (on
        time.monotonic), each attempt tells the worker the seconds left (TIMEOUT_HEADER)."""
        now = time.monotonic()
        prefill_url: str | None = None
        if self.disagg is not None:
            split = self.disagg.route(route, self.pool.views(now))
            decision, prefill_url = split.decode, split.prefill.worker_id
            prefill_hit_blocks = split.prefill.predicted_hit_blocks
            assert self.admin_key is not None
            headers = {**headers, PREFILL_URL_HEADER: prefill_url,
                       ADMIN_KEY_HEADER: self.admin_key}
            self.metrics.requests.labels(prefill_url, f"prefill_{split.prefill.branch}",
                                         self.policy_name).inc()
        else:
            decision = self.policy.route(route, self.pool.views(now))
            prefill_hit_blocks = decision.predicted_hit_blocks
        candidates = [decision.worker_id] + [u for u in decision.ranked
                                             if u != decision.worker_id]
        payload = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        last: NoWorkerAvailable | None = None
        for attempt, url in enumerate(candidates):
            # A worker that left the fleet since the decision takes no new request.
            state = self.pool.workers.get(url)
            if state is None or state.draining:
                continue
            if attempt > 0:
                if not state.takes_traffic(now):
                    continue
                if not self.budget.try_spend(time.monotonic()):
                    self.metrics.retry_denied.inc()
                    break
                self.metrics.retries.labels("backpressure" if last and last.status in
                                            BACKPRESSURE else "error").inc()
            worker = self.pool.get(url)
            worker.in_flight += 1
            worker.dispatched += 1
            # Recorded now, not when the worker answers: a kvserve worker sends its headers
            # with the first token, and a burst of one prefix arriving meanwhile must see where
            # it went (else each finds no holder and the prefix is computed on every worker).
            if self.disagg is not None and prefill_url is not None:
                self.disagg.observe(route, prefill_url, url)
            else:
                self.policy.observe(route, url)
            if attempt == 0:
                self.metrics.added_latency.observe(time.monotonic() - started)
            # The prefill worker is busy with this request until the decode worker answers
            # (a kvserve worker sends its headers once the KV arrived and a token is out).
            prefill = self.pool.get(prefill_url) if prefill_url is not None else None
            if prefill is not None:
                prefill.in_flight += 1
                prefill.dispatched += 1
            # The prompt's prefill is work ahead of later requests on the worker computing it,
            # until the first byte (a kvserve worker answers with its first token). A unified
            # retry goes where the policy predicted nothing: count the whole prompt there.
            computing = prefill if prefill is not None else worker
            backlog = route.uncached_tokens(
                prefill_hit_blocks if attempt == 0 or prefill is not None else 0)
            computing.prefill_backlog_tokens += backlog
            sent = headers if deadline is None else {
                **headers, TIMEOUT_HEADER: format_timeout(deadline - time.monotonic())}
            try:
                response = await self.client.post(f"{url}{path}", payload, sent,
                                                  self.read_timeout_s)
            except UpstreamError as exc:
                self.pool.record_failure(url, f"{type(exc).__name__}: {exc}", time.monotonic())
                self.metrics.upstream_errors.labels(url, type(exc).__name__).inc()
                self.pool.end_request(worker)  # last: a draining worker may be forgotten now
                last = NoWorkerAvailable(f"worker {url} unreachable: {type(exc).__name__}")
                continue
            except BaseException:  # cancelled, or a header that cannot be sent: nothing is open
                self.pool.end_request(worker)
                raise
            finally:
                computing.prefill_backlog_tokens -= backlog
                if prefill is not None:
                    self.pool.end_request(prefill)
            if response.status_code in BACKPRESSURE:
                content: bytes | None = None  # unreadable: the gateway answers for it
                try:
                    content = await response.aread()
                except UpstreamError:
                    pass
                finally:
                    await response.aclose()
                    self.pool.end_request(worker)
                self.pool.record_backpressure(url)
                last = NoWorkerAvailable(f"worker {url} is saturated", response.status_code,
                                         content, response.headers.get("retry-after"))
                continue
            self.pool.record_success(url)
            worker.requests += 1
            branch = decision.branch if attempt == 0 else "failover"
            self.metrics.requests.labels(url, str(branch), self.policy_name).inc()
            predicted: int | None = None
            if attempt == 0:
                self.metrics.predicted_hit_blocks.inc(decision.predicted_hit_blocks)
                if self.disagg is None:
                    predicted = min(route.num_tokens,
                                    decision.predicted_hit_blocks * route.block_tokens)
            return Upstream(url, response, decision, self.pool,
                            predicted_cached_tokens=predicted)
        raise last or NoWorkerAvailable("no healthy worker")
