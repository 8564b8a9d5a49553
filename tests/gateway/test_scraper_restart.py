"""A worker that restarted caches nothing: the scraper sees its prefix-cache counter go down and
the policy forgets its index of that worker, instead of sending tenants to a cold cache as if
it still held their prefixes."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvserve.gateway.core.pipeline import Branch, CacheAwarePolicy
from kvserve.gateway.fleet.scraper import Scraper, apply_metrics
from kvserve.gateway.fleet.upstream_http import UpstreamClient
from kvserve.gateway.fleet.worker_pool import WorkerPool, WorkerState
from tests.gateway.helpers import request, views
from tests.gateway.loopback import loopback_workers


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
    asyncio.run(_forget_a_restarted_worker())


async def _forget_a_restarted_worker() -> None:
    counters: dict[str, float] = {}

    def answer(url: str, path: str) -> tuple[int, str]:
        return (200, "ok") if path == "/health" else (200, exposition(counters[url], 0.0))

    policy = CacheAwarePolicy()
    tenant = request("a long shared prefix " * 20, "acme")
    client = UpstreamClient()
    async with loopback_workers(2, answer) as (a, b):
        counters.update({a: 500.0, b: 500.0})
        policy.observe(tenant, a)
        scraper = Scraper(WorkerPool([a, b]), client, on_restart=policy.remove_worker)
        await scraper.scrape_once()
        assert policy.route(tenant, views({a: 0, b: 0})).branch \
            == Branch.AFFINITY  # still held: no restart seen
        counters[a] = 2.0  # worker a came back as a new process
        await scraper.scrape_once()
        await client.aclose()
    assert policy.index_size(a) == 0
    decision = policy.route(tenant, views({a: 0, b: 0}))
    assert decision.branch == Branch.LEAST_LOAD and decision.predicted_hit_blocks == 0


def test_only_the_wanted_series_are_read_summed_over_label_sets() -> None:
    text = "\n".join([
        "# HELP vllm:num_requests_running Requests in the model's batch.",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{model_name="a",engine="0"} 3.0',
        'vllm:num_requests_running{model_name="a",engine="1"} 2.0',
        'vllm:num_requests_running_extra{model_name="a"} 100.0',  # another series' name
        "vllm:num_requests_waiting 4 1700000000000",  # no labels, with a timestamp
        'vllm:prefix_cache_queries_total{model_name="a"} 1e3',
        'vllm:prefix_cache_queries_created{model_name="a"} 1.7e9',  # not a count
        'vllm:prefix_cache_hits{model_name="a"} 250',  # a counter without _total
        'vllm:kv_cache_usage_perc{model_name="a}b"} 0.5',  # a brace inside a label value
        'vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="a"} 7.0',
        "vllm:num_requests_waiting{broken 1.0",  # malformed: skipped, not fatal
        "vllm:num_requests_waiting{} not-a-number",
    ])
    worker = WorkerState("http://w")
    apply_metrics(worker, text)
    assert (worker.num_running, worker.num_waiting, worker.kv_usage) == (5, 4, 0.5)
    assert (worker.prefix_queries, worker.prefix_hits) == (1000.0, 250.0)


def test_an_exposition_written_by_prometheus_client_is_read() -> None:
    registry = CollectorRegistry()
    Gauge("vllm:num_requests_running", "r", ["model_name"], registry=registry) \
        .labels("m").set(2)
    Counter("vllm:prefix_cache_queries", "q", ["model_name"], registry=registry) \
        .labels("m").inc(640)
    Histogram("vllm:e2e_request_latency_seconds", "e", ["model_name"], registry=registry) \
        .labels("m").observe(0.3)
    worker = WorkerState("http://w")
    apply_metrics(worker, generate_latest(registry).decode())
    assert (worker.num_running, worker.prefix_queries) == (2, 640.0)


def test_a_scrape_that_fails_past_http_errors_marks_that_worker_alone_and_the_round_goes_on(
        ) -> None:
    asyncio.run(_one_failing_scrape())


async def _one_failing_scrape() -> None:
    def answer(url: str, path: str) -> tuple[int, str]:
        return (200, "ok") if path == "/health" else (200, exposition(10.0, 0.0))

    client = UpstreamClient()
    async with loopback_workers(2, answer) as (a, b):
        pool = WorkerPool([a, b])

        def on_capacity(url: str, tokens: int) -> None:
            raise AssertionError("unreached: these pages declare no capacity")

        def on_restart(url: str) -> None:
            if url == a:
                raise RuntimeError("a policy's index refused the restart")

        scraper = Scraper(pool, client, on_restart=on_restart, on_capacity=on_capacity)
        await scraper.scrape_once()
        pool.workers[b].healthy = False  # ejected meanwhile: the next good scrape readmits it
        apply_metrics(pool.workers[a], exposition(99.0, 0.0))  # a's next page is a "restart"
        await scraper.scrape_once()  # a's callback raises; b's scrape must still land
        await client.aclose()
    assert pool.workers[b].healthy
    assert not pool.workers[a].healthy
    assert "a policy's index refused the restart" in (pool.workers[a].last_error or "")
