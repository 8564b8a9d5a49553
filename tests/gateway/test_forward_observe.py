"""The forwarder records where a prefix went when it sends it, not when the worker answers: a
kvserve worker answers with its first token, and a burst of one prefix arriving meanwhile must
follow the first request instead of computing the prefix on every worker. Until then the prompt
also counts as the worker's prefill backlog."""

from __future__ import annotations

import asyncio
import contextlib
import socket

from kvserve.gateway.admission import Admission
from kvserve.gateway.forward import Forwarder
from kvserve.gateway.metrics import GatewayMetrics
from kvserve.gateway.policies import Branch, CacheAwarePolicy, DisaggregatedRouter, LeastLoadPolicy
from kvserve.gateway.retry_budget import RetryBudget
from kvserve.gateway.upstream_http import UpstreamClient
from kvserve.gateway.worker_pool import WorkerPool
from tests.gateway.helpers import request


def test_a_second_request_follows_the_first_before_the_worker_answers() -> None:
    silent = [socket.socket(), socket.socket()]  # accept connections, never answer: slow workers
    for sock in silent:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
    urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in silent]

    async def scenario() -> None:
        pool = WorkerPool(urls)
        policy = CacheAwarePolicy()
        budget = RetryBudget()
        metrics = GatewayMetrics(pool, Admission(8, 8, 1.0), budget)
        client = UpstreamClient()
        try:
            forwarder = Forwarder(pool, policy, client, budget, metrics, "cache_aware", 30.0)
            route = request("the tenant's long shared system prompt " * 8, "acme")
            first = asyncio.create_task(forwarder.open("/v1/completions", {"prompt": "x"}, {},
                                                       route, 0.0))
            await asyncio.sleep(0.3)  # the first request is out, its worker silent
            assert not first.done()
            decision = policy.route(route, pool.views(0.0))
            chosen = [u for u in urls if pool.get(u).in_flight == 1]
            assert [decision.worker_id] == chosen and decision.branch == Branch.AFFINITY
            # Unanswered, the whole prompt is prefill work ahead on that worker; a second
            # request of the prefix adds only what it will not find cached.
            worker = pool.get(chosen[0])
            assert worker.prefill_backlog_tokens == route.num_tokens > 0
            longer = request("the tenant's long shared system prompt " * 8 + "and a question",
                             "acme")
            second = asyncio.create_task(forwarder.open("/v1/completions", {"prompt": "y"}, {},
                                                        longer, 0.0))
            await asyncio.sleep(0.3)
            assert worker.in_flight == 2
            assert worker.prefill_backlog_tokens == route.num_tokens + longer.uncached_tokens(
                len(route.prefix_hashes))
            assert longer.uncached_tokens(len(route.prefix_hashes)) < longer.num_tokens
            for task in (first, second):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            assert (worker.in_flight, worker.prefill_backlog_tokens) == (0, 0)
        finally:
            await client.aclose()

    try:
        asyncio.run(scenario())
    finally:
        for sock in silent:
            sock.close()


def test_in_disaggregated_mode_the_backlog_is_the_prefill_workers() -> None:
    silent = [socket.socket() for _ in range(3)]
    for sock in silent:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
    urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in silent]
    prefill_url, decode_urls = urls[0], urls[1:]

    async def scenario() -> None:
        pool = WorkerPool(urls)
        budget = RetryBudget()
        metrics = GatewayMetrics(pool, Admission(8, 8, 1.0), budget)
        client = UpstreamClient()
        disagg = DisaggregatedRouter(CacheAwarePolicy(), LeastLoadPolicy(seed=0), [prefill_url],
                                     decode_urls)
        try:
            forwarder = Forwarder(pool, disagg.prefill_policy, client, budget, metrics,
                                  "cache_aware", 30.0, disagg=disagg, admin_key="k")
            route = request("a prompt the prefill worker computes " * 8, "acme")
            task = asyncio.create_task(forwarder.open("/v1/completions", {"prompt": "x"}, {},
                                                      route, 0.0))
            await asyncio.sleep(0.3)  # out to a decode worker, which waits for the KV
            assert pool.get(prefill_url).prefill_backlog_tokens == route.num_tokens > 0
            assert [pool.get(u).prefill_backlog_tokens for u in decode_urls] == [0, 0]
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            assert all(pool.get(u).prefill_backlog_tokens == 0 for u in urls)
            assert all(pool.get(u).in_flight == 0 for u in urls)
        finally:
            await client.aclose()

    try:
        asyncio.run(scenario())
    finally:
        for sock in silent:
            sock.close()
