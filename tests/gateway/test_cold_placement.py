"""cache_aware's placement of a prefix its index holds nowhere: by default where every replica
puts it (rendezvous order), so replicas with different histories agree, a full index passed
over; by footprint on request, which only this gateway knows (not replica-safe)."""

from __future__ import annotations

import pytest

from kvserve.gateway.core.pipeline import (
    Branch,
    CacheAwarePolicy,
    PrecisePolicy,
    PrefixHashPolicy,
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


def test_the_default_places_a_new_prefix_where_every_replica_does() -> None:
    policy = make_policy("cache_aware")
    assert isinstance(policy, CacheAwarePolicy) and policy.replica_safe
    workers = views(fleet(2))
    tenants = [request(f"tenant {i} prompt " * 4, f"t{i}") for i in range(12)]
    stateless = PrefixHashPolicy()
    for req in tenants:  # by footprint, each would go to the index emptier by then
        chosen = policy.route(req, workers).worker_id
        assert chosen == stateless.route(req, workers).worker_id
        policy.observe(req, chosen)
    assert not make_policy("cache_aware", cold_placement="footprint").replica_safe
    assert all(make_policy(name).replica_safe
               for name in ("round_robin", "least_load", "prefix_hash", "precise"))


def test_an_unknown_cold_placement_is_refused() -> None:
    with pytest.raises(ValueError, match="cold_placement must be one of rendezvous, footprint"):
        make_policy("cache_aware", cold_placement="nearest")


def test_precise_replicas_place_new_prefixes_alike() -> None:
    """`precise`'s replicas share the workers' events but not what each sent and is still
    pending: a prefix no worker holds goes in rendezvous order, so they agree on it too."""
    workers = views(fleet(4))
    first, second = PrecisePolicy(), PrecisePolicy()
    for i, req in enumerate(random_requests(40, seed=1)):  # each sent its own traffic
        (first if i % 2 else second).observe(req, f"w{i % 4}")
    stateless = PrefixHashPolicy()
    for req in random_requests(60, seed=2):
        a, b = first.route(req, workers), second.route(req, workers)
        assert a.worker_id == b.worker_id == stateless.route(req, workers).worker_id
        assert (a.branch, a.predicted_hit_blocks) == (Branch.LEAST_LOAD, 0)
