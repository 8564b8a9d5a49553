"""A worker that restarted caches nothing: the scraper sees its prefix-cache counter go down and
the policy forgets its index of that worker, instead of sending tenants to a cold cache as if
it still held their prefixes."""

from __future__ import annotations

import asyncio

import httpx

from kvserve.gateway.policies import Branch, CacheAwarePolicy
from kvserve.gateway.scraper import Scraper, apply_metrics
from kvserve.gateway.worker_pool import WorkerPool, WorkerState
from tests.gateway.helpers import request, views


def exposition(queries: float, hits: float) -> str:
    return ("# TYPE vllm:prefix_cache_queries_total counter\n"
            f"vllm:prefix_cache_queries_total{{model_name=\"m\"}} {queries}\n"
            "# TYPE vllm:prefix_cache_hits_total counter\n"
            f"vllm:prefix_cache_hits_total{{model_name=\"m\"}} {hits}\n")


def test_a_counter_that_goes_down_is_a_restart() -> None:
    worker = WorkerState("http://w")
    assert apply_metrics(worker, exposition(100.0, 80.0)) is False  # first scrape
    assert apply_metrics(worker, exposition(150.0, 120.0)) is False
    assert apply_metrics(worker, exposition(150.0, 120.0)) is False  # idle: unchanged
    assert apply_metrics(worker, exposition(3.0, 0.0)) is True
    assert (worker.prefix_queries, worker.prefix_hits) == (3.0, 0.0)
    assert apply_metrics(worker, "") is False  # no series: nothing known, nothing reset


def test_the_scraper_makes_the_policy_forget_a_restarted_worker() -> None:
    counters = {"http://a": 500.0, "http://b": 500.0}

    def handler(req: httpx.Request) -> httpx.Response:
        url = f"{req.url.scheme}://{req.url.host}"
        if req.url.path == "/health":
            return httpx.Response(200)
        return httpx.Response(200, text=exposition(counters[url], 0.0))

    policy = CacheAwarePolicy()
    tenant = request("a long shared prefix " * 20, "acme")
    policy.observe(tenant, "http://a")
    pool = WorkerPool(["http://a", "http://b"])

    async def scenario() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            scraper = Scraper(pool, client, on_restart=policy.remove_worker)
            await scraper.scrape_once()
            assert policy.route(tenant, views({"http://a": 0, "http://b": 0})).branch \
                == Branch.AFFINITY  # still held: no restart seen
            counters["http://a"] = 2.0  # worker a came back as a new process
            await scraper.scrape_once()

    asyncio.run(scenario())
    assert policy.index_size("http://a") == 0
    decision = policy.route(tenant, views({"http://a": 0, "http://b": 0}))
    assert decision.branch == Branch.LEAST_LOAD and decision.predicted_hit_blocks == 0
