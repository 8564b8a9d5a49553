"""The forwarder records where a prefix went when it sends it, not when the worker answers: a
kvserve worker answers with its first token, and a burst of one prefix arriving meanwhile must
follow the first request instead of computing the prefix on every worker. Until then the prompt
also counts as the prefill backlog of the worker computing it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable, Iterator

from kvserve.gateway.core.pipeline import (
    Branch,
    CacheAwarePolicy,
    DisaggregatedRouter,
    LeastLoadPolicy,
)
from kvserve.gateway.core.retry_budget import RetryBudget
from kvserve.gateway.fleet.admission import Admission
from kvserve.gateway.fleet.metrics import GatewayMetrics
from kvserve.gateway.fleet.upstream_http import UpstreamClient
from kvserve.gateway.fleet.worker_pool import WorkerPool
from kvserve.gateway.proxy.forward import Forwarder
from tests.gateway.helpers import request

Scenario = Callable[[WorkerPool, GatewayMetrics, RetryBudget, UpstreamClient], Awaitable[None]]


@contextlib.contextmanager
def silent_workers(count: int) -> Iterator[list[str]]:
    """URLs of `count` listening sockets that accept connections and never answer."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
            sock.listen(8)
        yield [f"http://127.0.0.1:{s.getsockname()[1]}" for s in socks]
    finally:
        for sock in socks:
            sock.close()


def run_scenario(urls: list[str], scenario: Scenario) -> None:
    async def main() -> None:
        pool = WorkerPool(urls)
        budget = RetryBudget()
        client = UpstreamClient()
        try:
            await scenario(pool, GatewayMetrics(pool, Admission(8, 8, 1.0), budget), budget,
                           client)
        finally:
            await client.aclose()

    asyncio.run(main())


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Yield to the event loop until `condition()` holds; fail naming `what` on timeout."""
    end = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def cancel(*tasks: asyncio.Task[object]) -> None:
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_a_second_request_follows_the_first_before_the_worker_answers() -> None:
    async def scenario(pool: WorkerPool, metrics: GatewayMetrics, budget: RetryBudget,
                       client: UpstreamClient) -> None:
        policy = CacheAwarePolicy()
        forwarder = Forwarder(pool, policy, client, budget, metrics, "cache_aware", 30.0)
        route = request("the tenant's long shared system prompt " * 8, "acme")
        first = asyncio.create_task(forwarder.open("/v1/completions", {"prompt": "x"}, {},
                                                   forwarder.dispatch(route, 0.0)))
        await until(lambda: sum(pool.get(u).in_flight for u in pool.urls) == 1,
                    "the first request to be out, its worker silent")
        assert not first.done()
        decision = policy.route(route, pool.views(0.0))
        chosen = [u for u in pool.urls if pool.get(u).in_flight == 1]
        assert [decision.worker_id] == chosen and decision.branch == Branch.AFFINITY
        # Unanswered, the whole prompt is prefill work ahead on that worker; a second request
        # of the prefix adds only what it will not find cached.
        worker = pool.get(chosen[0])
        assert worker.prefill_backlog_tokens == route.num_tokens > 0
        longer = request("the tenant's long shared system prompt " * 8 + "and a question",
                         "acme")
        second = asyncio.create_task(forwarder.open("/v1/completions", {"prompt": "y"}, {},
                                                    forwarder.dispatch(longer, 0.0)))
        await until(lambda: worker.in_flight == 2, "the second request to follow the first")
        held = len(route.prefix_hashes)
        assert worker.prefill_backlog_tokens == route.num_tokens + longer.uncached_tokens(held)
        assert longer.uncached_tokens(held) < longer.num_tokens
        await cancel(first, second)
        assert (worker.in_flight, worker.prefill_backlog_tokens) == (0, 0)

    with silent_workers(2) as urls:
        run_scenario(urls, scenario)


def test_in_disaggregated_mode_the_backlog_is_the_prefill_workers() -> None:
    async def scenario(pool: WorkerPool, metrics: GatewayMetrics, budget: RetryBudget,
                       client: UpstreamClient) -> None:
        prefill_url, *decode_urls = pool.urls
        disagg = DisaggregatedRouter(CacheAwarePolicy(), LeastLoadPolicy(seed=0), [prefill_url],
                                     decode_urls)
        forwarder = Forwarder(pool, disagg, client, budget, metrics, "cache_aware", 30.0,
                              admin_key="k")
        route = request("a prompt the prefill worker computes " * 8, "acme")
        task = asyncio.create_task(forwarder.open("/v1/completions", {"prompt": "x"}, {},
                                                  forwarder.dispatch(route, 0.0)))
        await until(lambda: pool.get(prefill_url).prefill_backlog_tokens > 0,
                    "the request to be out to a decode worker, which waits for the KV")
        assert pool.get(prefill_url).prefill_backlog_tokens == route.num_tokens > 0
        assert [pool.get(u).prefill_backlog_tokens for u in decode_urls] == [0, 0]
        await cancel(task)
        assert all((pool.get(u).in_flight, pool.get(u).prefill_backlog_tokens) == (0, 0)
                   for u in pool.urls)

    with silent_workers(3) as urls:
        run_scenario(urls, scenario)
