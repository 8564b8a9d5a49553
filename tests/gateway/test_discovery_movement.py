"""Rendezvous placement under a changing fleet, on the real policies and the real pool: a
worker added among N takes ~1/(N+1) of the prefixes (and only those move), a worker removed
gives up only its own."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvserve.gateway.core.pipeline import RouteRequest, RoutingPolicy, make_policy
from kvserve.gateway.fleet.worker_pool import WorkerPool
from tests.gateway.helpers import random_requests

KEYS = random_requests(2000, seed=26)
URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 6)]
TOLERANCE = 0.04  # 2000 keys: the binomial's standard deviation is ~0.009 of them


def placement(policy: RoutingPolicy, pool: WorkerPool,
              requests: list[RouteRequest]) -> list[str]:
    return [policy.route(r, pool.views(0.0)).worker_id for r in requests]


def trained(name: str) -> Callable[[WorkerPool], RoutingPolicy]:
    """A policy that has seen every key once on the four-worker fleet (an index of what each
    worker caches, for cache_aware), forgetting a worker when the pool does."""
    def make(pool: WorkerPool) -> RoutingPolicy:
        policy = make_policy(name)
        pool.on_forgotten.append(policy.remove_worker)
        for request, worker in zip(KEYS, placement(policy, pool, KEYS), strict=True):
            policy.observe(request, worker)
        return policy
    return make


@pytest.mark.parametrize("name", ["prefix_hash", "cache_aware"])
def test_a_fifth_worker_takes_a_fifth_of_the_new_prefixes_and_only_those_move(
        name: str) -> None:
    pool = WorkerPool(URLS[:4])
    policy = make_policy(name)
    before = placement(policy, pool, KEYS)
    pool.add(URLS[4])
    after = placement(policy, pool, KEYS)
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert abs(len(moved) / len(KEYS) - 1 / 5) < TOLERANCE, len(moved)
    assert {a for _, a in moved} == {URLS[4]}  # a key moves only to the newcomer


@pytest.mark.parametrize("name", ["prefix_hash", "cache_aware"])
def test_removing_a_worker_moves_only_its_own_prefixes(name: str) -> None:
    pool = WorkerPool(URLS[:4])
    policy = trained(name)(pool)
    before = placement(policy, pool, KEYS)
    gone = URLS[1]
    pool.remove(gone)  # idle: forgotten at once, with its index entries
    after = placement(policy, pool, KEYS)
    assert gone not in after
    for b, a in zip(before, after, strict=True):
        assert a == b or b == gone
    share = before.count(gone) / len(KEYS)
    assert abs(share - 1 / 4) < TOLERANCE
    # Its prefixes spread over the three left, as they would have on a three-worker fleet.
    fresh = placement(make_policy(name), WorkerPool([u for u in URLS[:4] if u != gone]), KEYS)
    assert after == fresh


def test_cache_aware_keeps_cached_prefixes_where_they_are_when_a_worker_joins() -> None:
    """With an index of what each worker caches, a newcomer takes none of the cached prefixes
    (they hit where they are) and the rendezvous share of the new ones."""
    pool = WorkerPool(URLS[:4])
    policy = trained("cache_aware")(pool)
    before = placement(policy, pool, KEYS)
    pool.add(URLS[4])
    assert placement(policy, pool, KEYS) == before
    new_keys = random_requests(2000, seed=27)
    share = placement(policy, pool, new_keys).count(URLS[4]) / len(new_keys)
    assert abs(share - 1 / 5) < TOLERANCE
