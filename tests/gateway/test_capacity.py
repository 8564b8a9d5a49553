"""`cache_aware` cannot see a worker evict, so its index of a worker holds no more than the
worker's KV cache can, learned from the worker's /metrics. The case that needs it: while one
worker is down, the other takes every tenant and keeps only the most recent; when the first
comes back, the tenants the survivor dropped must go to the empty worker, not stay pinned to a
cache that no longer holds them."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.gateway.core.pipeline import (
    BlockIndex,
    Branch,
    CacheAwarePolicy,
    CapacityAware,
    RouteRequest,
)
from kvserve.gateway.core.prefix import CHARS_PER_TOKEN
from kvserve.gateway.fleet.scraper import Scraper, apply_metrics
from kvserve.gateway.fleet.text_capacity import MIN_SAMPLES, TextCapacity
from kvserve.gateway.fleet.upstream_http import UpstreamClient
from kvserve.gateway.fleet.worker_pool import WorkerPool, WorkerState
from kvserve.model.demo_tokenizer import build_tokenizer
from tests.gateway.helpers import request, views
from tests.gateway.loopback import loopback_workers

BLOCKS_PER_TENANT = 6  # 48 characters in the helper's 8-character blocks of 2 tokens


def tenant_request(tenant: int) -> RouteRequest:
    return request(f"{tenant:02d}" * 24, f"tenant-{tenant}")


def cache_config(num_gpu_blocks: str, block_size: str = "16") -> str:
    return ("# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="{block_size}",enable_prefix_caching="True",'
            f'num_gpu_blocks="{num_gpu_blocks}"}} 1.0\n')


def test_resize_evicts_the_least_recent_blocks() -> None:
    index = BlockIndex(8)
    index.touch_chain([b"a1", b"a2", b"a3"])
    index.touch_chain([b"b1", b"b2", b"b3"])
    index.resize(4)
    # A chain is evicted from its tail: what is left of `a` is its head.
    assert len(index) == 4 and b"a1" in index and b"a2" not in index and b"b3" in index
    with pytest.raises(ValueError, match="capacity >= 1"):
        index.resize(0)


def test_tenants_the_survivor_dropped_go_to_the_worker_that_comes_back() -> None:
    policy = CacheAwarePolicy()
    assert isinstance(policy, CapacityAware)
    two_tenants = 2 * BLOCKS_PER_TENANT * tenant_request(0).block_tokens
    for worker in ("a", "b"):
        policy.set_worker_capacity(worker, two_tenants)
    tenants = [tenant_request(t) for t in range(4)]
    # b is down: every tenant goes to a, oldest first; a's cache keeps the last two.
    for req in tenants:
        decision = policy.route(req, views({"a": 0, "b": 0}, unhealthy=["b"]))
        assert decision.worker_id == "a"
        policy.observe(req, "a")
    assert policy.index_size("a") == 2 * BLOCKS_PER_TENANT
    back = views({"a": 0, "b": 0})
    for req in tenants[:2]:  # dropped by a: nobody holds them, the empty worker takes them
        decision = policy.route(req, back)
        assert (decision.worker_id, decision.branch) == ("b", Branch.LEAST_LOAD)
    for req in tenants[2:]:  # still cached on a
        decision = policy.route(req, back)
        assert (decision.worker_id, decision.branch) == ("a", Branch.AFFINITY)
        assert decision.predicted_hit_blocks == BLOCKS_PER_TENANT


def test_without_a_known_capacity_every_tenant_stays_pinned_to_the_survivor() -> None:
    """What the capacity prevents: the index believes a holds all four tenants."""
    policy = CacheAwarePolicy()
    tenants = [tenant_request(t) for t in range(4)]
    for req in tenants:
        policy.observe(req, "a")
    assert all(policy.route(req, views({"a": 0, "b": 0})).worker_id == "a"
               for req in tenants)


def test_capacity_is_counted_in_the_requests_blocks_and_capped_at_the_memory_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve.gateway.core.pipeline import indexes as cache_aware

    monkeypatch.setattr(cache_aware, "MAX_BLOCKS_PER_WORKER", 10)
    policy = CacheAwarePolicy()
    req = tenant_request(0)
    block_tokens = req.block_tokens
    policy.set_worker_capacity("a", 3 * block_tokens + block_tokens - 1)  # 3 whole blocks
    policy.observe(req, "a")
    assert policy.index_size("a") == 3
    policy.set_worker_capacity("a", 1000 * block_tokens)  # more than the option allows
    policy.observe(tenant_request(1), "a")
    assert policy.index_size("a") == 3 + BLOCKS_PER_TENANT
    policy.observe(tenant_request(2), "a")
    assert policy.index_size("a") == 10
    policy.remove_worker("a")  # a restart empties the index, the capacity stays
    policy.observe(req, "a")
    policy.observe(tenant_request(1), "a")
    assert policy.index_size("a") == 10
    with pytest.raises(ValueError, match="must be >= 1 token"):
        policy.set_worker_capacity("a", 0)


def test_the_capacity_is_read_from_the_cache_config_info_labels() -> None:
    worker = WorkerState("http://w")
    apply_metrics(worker, cache_config("None"))  # vLLM before it sized its cache
    assert worker.kv_capacity_tokens == 0
    apply_metrics(worker, cache_config("1024"))
    assert worker.kv_capacity_tokens == 1024 * 16
    apply_metrics(worker, "")  # a scrape without the series keeps what was known
    assert worker.kv_capacity_tokens == 1024 * 16
    apply_metrics(worker, "# TYPE sglang:max_total_num_tokens gauge\n"
                          'sglang:max_total_num_tokens{model_name="m"} 161721.0\n')
    assert worker.kv_capacity_tokens == 161721


def test_the_scraper_tells_the_policy_each_new_capacity_once() -> None:
    asyncio.run(_tell_each_new_capacity_once())


async def _tell_each_new_capacity_once() -> None:
    blocks: dict[str, str] = {}

    def answer(url: str, path: str) -> tuple[int, str]:
        return (200, "ok") if path == "/health" else (200, cache_config(blocks[url]))

    told: list[tuple[str, int]] = []
    client = UpstreamClient()
    async with loopback_workers(2, answer) as (a, b):
        blocks.update({a: "512", b: "256"})
        scraper = Scraper(WorkerPool([a, b]), client,
                          on_capacity=lambda url, tokens: told.append((url, tokens)))
        await scraper.scrape_once()
        await scraper.scrape_once()  # unchanged: not told again
        blocks[b] = "128"  # b restarted with a smaller cache
        await scraper.scrape_once()
        await client.aclose()
    assert sorted(told[:2]) == sorted([(a, 512 * 16), (b, 256 * 16)])
    assert told[2:] == [(b, 128 * 16)]


def _full_pair(policy: CacheAwarePolicy) -> list[RouteRequest]:
    """Tenants 0-5 sent alternately to a and b, each caching two: 0-3 are forgotten."""
    two_tenants = 2 * BLOCKS_PER_TENANT * tenant_request(0).block_tokens
    for worker in ("a", "b", "c"):
        policy.set_worker_capacity(worker, two_tenants)
    tenants = [tenant_request(t) for t in range(6)]
    for i, req in enumerate(tenants):
        policy.observe(req, "ab"[i % 2])
    return tenants


class _Told:
    """A CapacityAware policy that records what it is told."""

    def __init__(self) -> None:
        self.told: dict[str, int] = {}

    def set_worker_capacity(self, worker_id: str, kv_tokens: int) -> None:
        self.told[worker_id] = kv_tokens


def test_text_keys_capacity_is_scaled_by_the_measured_characters_per_token() -> None:
    told = _Told()
    capacity = TextCapacity(told, every=2)
    capacity.worker_capacity("a", 16_384)
    assert told.told == {"a": 16_384}  # nothing measured yet: the assumed ratio
    prompt = "the gateway routes each request to the worker holding its prefix " * 20
    for _ in range(2 * MIN_SAMPLES):
        capacity.sample(prompt)  # no tokenizer: nothing measured
    assert capacity.samples == 0 and told.told == {"a": 16_384}
    tokenizer = build_tokenizer(300)
    capacity.tokenizer = tokenizer
    measured = len(prompt) / len(tokenizer.encode(prompt, add_special_tokens=False).ids)
    assert abs(measured - CHARS_PER_TOKEN) > 0.05 * CHARS_PER_TOKEN  # the test means something
    for i in range(MIN_SAMPLES):
        assert capacity.chars_per_token == CHARS_PER_TOKEN  # assumed until MIN_SAMPLES
        capacity.sample(f"{prompt} {i}")  # the first ones are all tokenized
    assert capacity.samples == MIN_SAMPLES
    assert capacity.chars_per_token == pytest.approx(measured, rel=0.01)
    assert told.told["a"] == pytest.approx(16_384 * measured / CHARS_PER_TOKEN, rel=0.01)
    for _ in range(2 * MIN_SAMPLES):
        capacity.sample(prompt)  # then one in two
    assert capacity.samples == 2 * MIN_SAMPLES
    capacity.worker_capacity("b", 1000)
    assert told.told["b"] == pytest.approx(1000 * measured / CHARS_PER_TOKEN, rel=0.01)
    with pytest.raises(ValueError, match="every must be >= 1"):
        TextCapacity(told, every=0)
