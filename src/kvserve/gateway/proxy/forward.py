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
from kvserve.gateway.core.lifecycle import BACKPRESSURE, Dispatch, Hold, Router
from kvserve.gateway.core.pipeline import RouteRequest
from kvserve.gateway.core.retry_budget import RetryBudget
from kvserve.gateway.fleet.metrics import GatewayMetrics
from kvserve.gateway.fleet.pool_ledger import PoolLedger
from kvserve.gateway.fleet.upstream_http import UpstreamClient, UpstreamError, UpstreamResponse
from kvserve.gateway.fleet.worker_pool import WorkerPool
from kvserve.wire.http import ADMIN_KEY_HEADER, PREFILL_URL_HEADER


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
    dispatch: Dispatch  # holds the request's counts on the worker until `close`
    closed: bool = False
    ended: bool = False  # the whole body was read: the worker is done with the request

    @property
    def predicted_cached_tokens(self) -> int | None:
        """Prompt tokens the policy expected this worker to serve from its cache
        (`Dispatch.predicted_cached_tokens`)."""
        return self.dispatch.predicted_cached_tokens()

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
            self.dispatch.end(finished=self.ended)
            await self.response.aclose()


class Forwarder:
    """Sends a dispatch's request over `pool` with `client`: to its pick, then its fallbacks
    while nothing has reached the client and the retry budget allows. A pick with a prefill
    worker (disaggregated routing) goes to the decode worker with a header naming the prefill
    worker it pulls the prompt's KV from, authenticated with `admin_key`."""

    def __init__(self, pool: WorkerPool, router: Router, client: UpstreamClient,
                 budget: RetryBudget, metrics: GatewayMetrics, policy_name: str,
                 request_timeout_s: float | None, admin_key: str | None = None) -> None:
        self.admin_key = admin_key
        self.pool = pool
        self.router = router
        self.ledger = PoolLedger(pool, metrics, policy_name)
        self.client = client
        self.budget = budget
        self.metrics = metrics
        self.read_timeout_s = request_timeout_s  # per read, as httpx's read timeout

    def dispatch(self, route: RouteRequest, started: float, admitted: float | None = None,
                 deadline: float | None = None, ttft_target_s: float | None = None,
                 hold: Hold | None = None) -> Dispatch:
        """A new request's lifecycle on this forwarder's pool and router (`admitted`: when
        admission let it through, default `started`)."""
        return Dispatch(self.router, self.ledger, route, started=started,
                        admitted=started if admitted is None else admitted, deadline=deadline,
                        ttft_target_s=ttft_target_s, hold=hold)

    async def open(self, path: str, body: dict[str, Any], headers: dict[str, str],
                   dispatch: Dispatch, deadline: float | None = None) -> Upstream:
        """The first worker (in ranked order) that accepts the request. With `deadline` (on
        time.monotonic), each attempt tells the worker the seconds left (TIMEOUT_HEADER)."""
        now = time.monotonic()
        decision = dispatch.pick(self.pool.views(now))
        if decision.prefill is not None:
            assert self.admin_key, "create_gateway checks disaggregated mode has one"
            headers = {**headers, PREFILL_URL_HEADER: decision.prefill.worker_id,
                       ADMIN_KEY_HEADER: self.admin_key}
        payload = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        last: NoWorkerAvailable | None = None
        for url in dispatch.candidates():
            # A worker that left the fleet since the decision takes no new request.
            state = self.pool.workers.get(url)
            if state is None or state.draining:
                continue
            reason = None
            if url != decision.worker_id:
                if not state.takes_traffic(now):
                    continue
                if not self.budget.try_spend(time.monotonic()):
                    self.metrics.retry_denied.inc()
                    break
                reason = "backpressure" if last and last.status in BACKPRESSURE else "error"
            dispatch.send(url, time.monotonic(), reason)
            sent = headers if deadline is None else {
                **headers, TIMEOUT_HEADER: format_timeout(deadline - time.monotonic())}
            try:
                response = await self.client.post(f"{url}{path}", payload, sent,
                                                  self.read_timeout_s)
            except UpstreamError as exc:
                self.pool.record_failure(url, f"{type(exc).__name__}: {exc}", time.monotonic())
                self.metrics.upstream_errors.labels(url, type(exc).__name__).inc()
                dispatch.failed()  # last: a draining worker may be forgotten now
                last = NoWorkerAvailable(f"worker {url} unreachable: {type(exc).__name__}")
                continue
            except BaseException:  # cancelled, or a header that cannot be sent: nothing is open
                dispatch.failed()
                raise
            if dispatch.answered_by(response.status_code):
                content: bytes | None = None  # unreadable: the gateway answers for it
                try:
                    content = await response.aread()
                except UpstreamError:
                    pass
                finally:
                    await response.aclose()
                    dispatch.failed()
                last = NoWorkerAvailable(f"worker {url} is saturated", response.status_code,
                                         content, response.headers.get("retry-after"))
                continue
            return Upstream(url, response, dispatch)
        raise last or NoWorkerAvailable("no healthy worker")
