"""cache_aware's placement of a prefix its index holds nowhere: by footprint when the gateway is
alone on its workers; where every replica puts it (rendezvous order) once the workers are
shared, so replicas with different histories agree; a full index passed over."""

from __future__ import annotations

import pytest

from kvserve.gateway.policies import (
    Branch,
    CacheAwarePolicy,
    PrefixHashPolicy,
    SharesWorkers,
    make_policy,
)
from tests.gateway.helpers import fleet, random_requests, request, views


def test_replicas_with_different_histories_place_new_prefixes_alike() -> None:
    workers = views(fleet(4))
    first, second = (CacheAwarePolicy(cold_placement="rendezvous") for _ in range(2))
    for i, req in enumerate(random_requests(40, seed=1)):  # each learned its own traffic
        (first if i % 2 else second).observe(req, f"w{i % 4}")
    new = random_requests(60, seed=2)
    stateless = PrefixHashPolicy()
    for req in new:
        a, b = first.route(req, workers), second.route(req, workers)
        assert a.worker_id == b.worker_id == stateless.route(req, workers).worker_id
        assert (a.branch, a.predicted_hit_blocks) == (Branch.LEAST_LOAD, 0)
    # By footprint instead, the two disagree on some of the same new prefixes.
    by_footprint = [CacheAwarePolicy(cold_placement="footprint") for _ in range(2)]
    for i, req in enumerate(random_requests(40, seed=1)):
        by_footprint[i % 2].observe(req, f"w{i % 4}")
    assert any(by_footprint[0].route(req, workers).worker_id
               != by_footprint[1].route(req, workers).worker_id for req in new)


def test_a_full_index_is_passed_over_while_another_has_room() -> None:
    policy = CacheAwarePolicy(cold_placement="rendezvous")
    workers = views(fleet(2))
    new = request("a new tenant's long system prompt " * 3, "fresh")
    first = PrefixHashPolicy().route(new, workers).worker_id
    other = "w1" if first == "w0" else "w0"
    blocks = len(new.prefix_hashes)
    policy.set_worker_capacity(first, 2 * blocks * new.block_tokens)
    policy.observe(request("x" * 8 * 2 * blocks, "old"), first)  # fills `first`'s index
    assert policy.index_size(first) == 2 * blocks
    assert policy.route(new, workers).worker_id == other
    policy.set_worker_capacity(other, 2 * blocks * new.block_tokens)
    policy.observe(request("y" * 8 * 2 * blocks, "old"), other)  # both full: the first choice
    assert policy.route(new, workers).worker_id == first


def test_auto_places_by_footprint_until_the_workers_are_shared() -> None:
    policy = make_policy("cache_aware")
    assert isinstance(policy, CacheAwarePolicy) and isinstance(policy, SharesWorkers)
    workers = views(fleet(2))
    tenants = [request(f"tenant {i} prompt " * 4, f"t{i}") for i in range(12)]
    for req in tenants[:6]:  # alone: each new tenant goes to the emptier index
        policy.observe(req, policy.route(req, workers).worker_id)
    assert policy.index_size("w0") > 0 and policy.index_size("w1") > 0
    assert not policy.places_cold_by_rendezvous
    policy.set_shared_workers(True)
    assert policy.places_cold_by_rendezvous
    # The index learned alone is forgotten: every prefix is placed where all replicas place it.
    assert policy.index_size("w0") == policy.index_size("w1") == 0
    stateless = PrefixHashPolicy()
    for req in tenants:
        assert policy.route(req, workers).worker_id == stateless.route(req, workers).worker_id
    policy.observe(tenants[0], "w0")
    policy.set_shared_workers(True)  # no change: the index is kept
    assert policy.index_size("w0") > 0
    policy.set_shared_workers(False)
    assert not policy.places_cold_by_rendezvous


def test_an_unknown_cold_placement_is_refused() -> None:
    with pytest.raises(ValueError, match="cold_placement must be one of auto, footprint"):
        make_policy("cache_aware", cold_placement="nearest")
