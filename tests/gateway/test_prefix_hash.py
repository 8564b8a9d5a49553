"""prefix_hash: bounded load under a hot prefix, deterministic spill, ~1/N remapping."""

from __future__ import annotations

import math
from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.gateway.core.pipeline import (
    Branch,
    PrefixHashPolicy,
    load_bound,
    rendezvous_key,
    rendezvous_order,
)
from tests.gateway.helpers import fleet, random_requests, request, views

HOT = request("the one hot system prompt everyone shares " * 8, "hot-tenant")


def bound(total_load: int, num_workers: int, c: float) -> int:
    return math.ceil(c * total_load / num_workers)


def replay_hot_prefix(
    policy: PrefixHashPolicy, num_workers: int, arrivals: list[int], lifetime: int
) -> list[tuple[str, dict[str, int]]]:
    """Replay `arrivals[t]` hot requests at step t, each done `lifetime` steps later; after every
    decision, assert the chosen worker is within the bound, and return (choice, loads) pairs."""
    loads = fleet(num_workers)
    outstanding: deque[tuple[int, str]] = deque()
    trace = []
    for step, count in enumerate(arrivals):
        while outstanding and outstanding[0][0] <= step - lifetime:
            loads[outstanding.popleft()[1]] -= 1
        for _ in range(count):
            worker = policy.route(HOT, views(loads)).worker_id
            loads[worker] += 1
            outstanding.append((step, worker))
            cap = bound(sum(loads.values()), num_workers, policy.load_factor)
            assert loads[worker] <= cap, (step, loads, cap)
            trace.append((worker, dict(loads)))
    return trace


def test_bounded_load_holds_at_all_times_under_a_single_hot_prefix() -> None:
    for num_workers, lifetime, c in ((4, 8, 1.25), (4, 3, 1.0), (5, 20, 1.25), (3, 7, 2.0)):
        policy = PrefixHashPolicy(load_factor=c)
        for _, loads in replay_hot_prefix(policy, num_workers, [1] * 200, lifetime):
            cap = bound(sum(loads.values()), num_workers, c)
            assert max(loads.values()) <= cap


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 6),
    st.lists(st.integers(0, 6), min_size=1, max_size=60),
    st.integers(1, 10),
    st.sampled_from([1.0, 1.1, 1.25, 1.5, 2.0]),
)
def test_bounded_load_holds_for_every_decision_under_bursts(
    num_workers: int, arrivals: list[int], lifetime: int, c: float
) -> None:
    replay_hot_prefix(PrefixHashPolicy(load_factor=c), num_workers, arrivals, lifetime)


@given(st.lists(st.integers(0, 50), min_size=1, max_size=8), st.floats(1.0, 3.0))
def test_some_worker_is_always_under_the_bound(loads: list[int], c: float) -> None:
    assert min(loads) < load_bound(sum(loads), len(loads), c)


def test_the_hot_prefix_spills_down_its_rendezvous_order() -> None:
    key = rendezvous_key("hot-tenant", HOT.prefix_hashes)
    order = [w.worker_id for w in rendezvous_order(key, views(fleet(4)))]
    policy = PrefixHashPolicy(load_factor=1.0)
    idle = policy.route(HOT, views(fleet(4)))
    assert (idle.worker_id, idle.branch, list(idle.ranked)) == (order[0], Branch.AFFINITY, order)
    # Total 8 -> bound ceil(9/4) = 3: the first choice (at 3) is full, the second takes it.
    loads = {order[0]: 3, order[1]: 2, order[2]: 2, order[3]: 1}
    spill = policy.route(HOT, views(loads))
    assert (spill.worker_id, spill.branch) == (order[1], Branch.SPILL)
    assert spill.ranked == (order[1], order[2], order[3], order[0])
    loads[order[1]] = 3  # total 9 -> bound 3: the next one down
    assert policy.route(HOT, views(loads)).worker_id == order[2]
    assert PrefixHashPolicy(load_factor=1.0).route(HOT, views(loads)).worker_id == order[2]


def test_a_request_without_a_full_block_goes_to_the_least_loaded() -> None:
    decision = PrefixHashPolicy().route(request("tiny"), views({"w0": 2, "w1": 0, "w2": 1}))
    assert (decision.worker_id, decision.branch) == ("w1", Branch.LEAST_LOAD)


def assignments(num_workers: int) -> list[str]:
    policy = PrefixHashPolicy()
    workers = views(fleet(num_workers))
    return [policy.route(r, workers).worker_id for r in random_requests(2000, seed=11)]


def test_adding_a_worker_moves_only_about_one_in_n_prefixes_all_to_it() -> None:
    before, after = assignments(4), assignments(5)
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert 0.5 / 5 <= len(moved) / 2000 <= 1.6 / 5
    assert {a for _, a in moved} == {"w4"}


def test_removing_a_worker_moves_only_the_prefixes_it_held() -> None:
    before, after = assignments(5), assignments(4)
    moved = [b for b, a in zip(before, after, strict=True) if b != a]
    assert 0.5 / 5 <= len(moved) / 2000 <= 1.6 / 5
    assert set(moved) == {"w4"} and len(moved) == before.count("w4")


def test_prefixes_spread_evenly_over_an_idle_fleet() -> None:
    counts = [assignments(4).count(f"w{i}") for i in range(4)]
    assert min(counts) > 0.8 * 500 and max(counts) < 1.2 * 500
