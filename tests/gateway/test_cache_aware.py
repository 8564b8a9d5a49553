"""cache_aware: a continuous cache-versus-load trade-off, and an index with bounded memory."""

from __future__ import annotations

import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.gateway.core.pipeline import BlockIndex, Branch, CacheAwarePolicy, RouteRequest
from tests.gateway.helpers import request, views

PROMPT = "".join(f"{i:08d}" for i in range(40))  # 40 blocks of 8 characters


def holder_policy(matched_blocks: int, credit: float, weight: float) -> CacheAwarePolicy:
    """A policy whose index says worker "a" holds the first `matched_blocks` blocks of PROMPT
    (no footprint term: these tests pin the cache-versus-load trade alone)."""
    policy = CacheAwarePolicy(block_credit=credit, load_weight=weight, footprint_weight=0.0)
    policy.observe(request(PROMPT[: 8 * matched_blocks]), "a")
    return policy


def sweep(policy: CacheAwarePolicy, load_b: int, max_load: int) -> list[str]:
    """The worker chosen for PROMPT as the holder's load rises from 0 to `max_load`."""
    return [
        policy.route(request(PROMPT), views({"a": load_a, "b": load_b})).worker_id
        for load_a in range(max_load + 1)
    ]


def switch_point(choices: list[str]) -> int:
    """The first load at which the holder loses; asserts it never wins again after that."""
    first = choices.index("b") if "b" in choices else len(choices)
    assert choices == ["a"] * first + ["b"] * (len(choices) - first), choices
    return first


def test_the_holder_keeps_the_prefix_until_its_load_outweighs_the_credit() -> None:
    policy = holder_policy(10, credit=1.0, weight=0.75)  # credit 10 = 13.3 requests of load
    choices = sweep(policy, load_b=0, max_load=30)
    assert switch_point(choices) == 14
    at_13 = policy.route(request(PROMPT), views({"a": 13, "b": 0}))
    at_14 = policy.route(request(PROMPT), views({"a": 14, "b": 0}))
    assert (at_13.branch, at_13.predicted_hit_blocks) == (Branch.AFFINITY, 10)
    assert (at_14.worker_id, at_14.branch, at_14.predicted_hit_blocks) == ("b", Branch.SPILL, 0)
    # Only the difference in load matters: the same trade with both workers busier.
    assert switch_point(sweep(policy, load_b=5, max_load=40)) == 19


def test_the_switch_point_moves_continuously_with_the_cached_prefix() -> None:
    """Unlike a hard affinity/shortest-queue switch at a fixed imbalance, the load a holder can
    carry grows step by step with how much of the prompt it holds."""
    sizes = range(1, 41, 3)  # 4m/3 is never a whole load, so no exact ties
    points = [switch_point(sweep(holder_policy(m, 1.0, 0.75), 0, 60)) for m in sizes]
    assert points == [4 * m // 3 + 1 for m in sizes]
    assert all(b > a for a, b in itertools.pairwise(points))


def test_a_new_prefix_goes_to_the_emptier_cache_unless_it_is_clearly_busier() -> None:
    policy = CacheAwarePolicy(load_weight=8.0, footprint_weight=16.0)
    for tenant in range(4):  # worker "a" holds four tenants' prefixes, "b" none
        policy.observe(request(PROMPT, f"old-{tenant}"), "a")
    new = request(PROMPT, "new-tenant")
    assert policy.route(new, views({"a": 0, "b": 0})).worker_id == "b"
    assert policy.route(new, views({"a": 0, "b": 1})).worker_id == "b"  # 8 < 16
    assert policy.route(new, views({"a": 0, "b": 3})).worker_id == "a"  # 24 > 16
    # A prefix somebody holds still follows its cache: the credit outweighs the footprint.
    held = policy.route(request(PROMPT, "old-0"), views({"a": 0, "b": 0}))
    assert (held.worker_id, held.branch) == ("a", Branch.AFFINITY)


def test_footprint_weight_is_checked() -> None:
    import pytest

    with pytest.raises(ValueError, match="footprint_weight"):
        CacheAwarePolicy(footprint_weight=-1.0)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 40),
    st.floats(0.1, 4.0),
    st.floats(0.1, 4.0),
    st.integers(0, 10),
)
def test_every_sweep_has_one_monotone_switch_at_the_predicted_load(
    matched: int, credit: float, weight: float, load_b: int
) -> None:
    policy = holder_policy(matched, credit, weight)
    point = switch_point(sweep(policy, load_b, load_b + int(matched * credit / weight) + 3))
    margin = matched * credit / weight  # a wins while load_a - load_b < margin (ties: either)
    assert load_b + margin - 1 <= point <= load_b + margin + 1


def test_a_new_prefix_goes_to_the_least_loaded_and_is_learned() -> None:
    policy = CacheAwarePolicy()
    req = request(PROMPT)
    first = policy.route(req, views({"a": 3, "b": 1, "c": 2}))
    assert (first.worker_id, first.branch, first.predicted_hit_blocks) == ("b", "least_load", 0)
    assert first.ranked == ("b", "c", "a")
    assert policy.route(req, views({"a": 3, "b": 1, "c": 2})) == first  # route changes nothing
    policy.observe(req, "b")
    again = policy.route(req, views({"a": 0, "b": 1, "c": 0}))
    assert (again.worker_id, again.branch, again.predicted_hit_blocks) == ("b", "affinity", 40)
    policy.remove_worker("b")
    assert policy.index_size("b") == 0
    assert policy.route(req, views({"a": 0, "b": 1, "c": 0})).branch == Branch.LEAST_LOAD


def test_a_partial_match_counts_only_the_shared_head() -> None:
    policy = CacheAwarePolicy()
    policy.observe(request(PROMPT), "a")
    forked = request(PROMPT[:80] + "a different continuation of the conversation")
    decision = policy.route(forked, views({"a": 0, "b": 0}))
    assert (decision.worker_id, decision.predicted_hit_blocks) == ("a", 10)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 64), st.lists(st.integers(0, 60), min_size=1, max_size=60), st.integers())
def test_the_index_never_exceeds_its_cap_and_keeps_the_latest_head(
    cap: int, chain_lengths: list[int], seed: int
) -> None:
    rng = random.Random(seed)
    policy = CacheAwarePolicy()
    policy.set_worker_capacity("w", cap * RouteRequest((), "t").block_tokens)
    for length in chain_lengths:
        hashes = tuple(rng.randbytes(32) for _ in range(length))
        if rng.random() < 0.3:  # sometimes a chain extends an earlier one
            hashes = tuple(rng.randbytes(32) for _ in range(length // 2)) + hashes
        req = RouteRequest(hashes, "t")
        policy.observe(req, "w")
        assert policy.index_size("w") <= cap
        assert policy.route(req, views({"w": 0})).predicted_hit_blocks == min(len(hashes), cap)


def test_lru_evicts_the_oldest_chain_from_its_tail() -> None:
    index = BlockIndex(8)
    old, new = [bytes([1, i]) for i in range(5)], [bytes([2, i]) for i in range(5)]
    index.touch_chain(old)
    index.touch_chain(new)
    assert len(index) == 8
    assert index.num_matched(old) == 3 and index.num_matched(new) == 5  # old lost its tail
    index.touch_chain(old[:1])  # a hit on old's root makes it recent again
    index.touch_chain([b"x", b"y"])  # evicts the two least recent: old's remaining tail
    assert old[0] in index and old[1] not in index and index.num_matched(new) == 5
    index.remove(new)
    assert index.num_matched(new) == 0 and len(index) == 3
    index.clear()
    assert len(index) == 0
