"""round_robin, least_load, the value objects, the factory and the no-healthy-worker error."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvserve.gateway.core.pipeline import (
    POLICY_NAMES,
    Branch,
    LeastLoadPolicy,
    NoHealthyWorker,
    RoundRobinPolicy,
    WorkerView,
    make_policy,
)
from tests.gateway.helpers import request, views

REQ = request("some prompt text that spans blocks")


def test_round_robin_rotates_over_healthy_workers_in_id_order() -> None:
    policy = RoundRobinPolicy()
    fleet = views({"w2": 0, "w0": 0, "w1": 0, "w3": 0}, unhealthy=["w1"])
    decisions = [policy.route(REQ, fleet) for _ in range(4)]
    assert [d.worker_id for d in decisions] == ["w0", "w2", "w3", "w0"]
    assert decisions[1].ranked == ("w2", "w3", "w0")
    assert {d.branch for d in decisions} == {Branch.ROUND_ROBIN}


def test_least_load_takes_the_less_loaded_of_two_and_breaks_ties_by_id() -> None:
    policy = LeastLoadPolicy(seed=1)
    assert policy.route(REQ, views({"a": 5, "b": 2})).worker_id == "b"
    decision = policy.route(REQ, views({"b": 3, "a": 3}))
    assert (decision.worker_id, decision.ranked, decision.branch) == ("a", ("a", "b"), "least_load")
    assert policy.route(REQ, views({"only": 9})).ranked == ("only",)


def test_least_load_never_picks_the_most_loaded_worker() -> None:
    policy = LeastLoadPolicy(rng=random.Random(7))
    fleet = views({"w0": 1, "w1": 1, "w2": 1, "w3": 9})
    chosen = Counter(policy.route(REQ, fleet).worker_id for _ in range(600))
    # Equal pairs go to the lower id, so w0 > w1 > w2, but each is reached.
    assert set(chosen) == {"w0", "w1", "w2"} and chosen["w0"] > chosen["w1"] > chosen["w2"]


def test_least_load_is_reproducible_with_a_seed() -> None:
    fleet = views({f"w{i}": i % 3 for i in range(6)})
    runs = [[LeastLoadPolicy(seed=3).route(REQ, fleet) for _ in range(50)] for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_no_healthy_worker_is_a_clear_error(name: str) -> None:
    policy = make_policy(name)
    for fleet in ([], views({"w0": 0, "w1": 0}, unhealthy=["w0", "w1"])):
        with pytest.raises(NoHealthyWorker, match="no healthy worker among") as info:
            policy.route(REQ, fleet)
        assert info.value.num_workers == len(fleet)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_decisions_rank_every_healthy_worker_once_chosen_first(name: str) -> None:
    policy = make_policy(name)
    fleet = views({"w0": 2, "w1": 0, "w2": 7, "w3": 1}, unhealthy=["w2"])
    for text in ("a" * 40, "b" * 40, "tiny"):
        decision = policy.route(request(text), fleet)
        assert decision.ranked[0] == decision.worker_id
        assert sorted(decision.ranked) == ["w0", "w1", "w3"]
        policy.observe(request(text), decision.worker_id)
        policy.remove_worker("w0")


def test_the_factory_checks_names_and_options_at_the_boundary() -> None:
    expected = {"round_robin", "least_load", "prefix_hash", "cache_aware", "precise",
                "lora_affinity"}
    assert set(POLICY_NAMES) == expected
    assert make_policy("prefix_hash", load_factor=1.5).name == "prefix_hash"
    with pytest.raises(ValueError, match="choose one of round_robin"):
        make_policy("random")
    with pytest.raises(ValueError, match="no option load_factr; its options are: prefix_blocks"):
        make_policy("prefix_hash", load_factr=2)
    with pytest.raises(ValueError, match=r"load_factor must be >= 1\.0"):
        make_policy("prefix_hash", load_factor=0.9)
    with pytest.raises(ValueError, match="load_weight must be a positive"):
        make_policy("cache_aware", load_weight=0)
    with pytest.raises(ValueError, match="no option home_weight; its options are: "
                       "block_credit, load_weight, footprint_weight, backlog_weight, "
                       "cold_placement"):
        make_policy("cache_aware", home_weight=4.0)  # cut: off by default, never won


def test_load_is_gateway_in_flight_plus_the_workers_waiting_queue() -> None:
    view = WorkerView("w", True, in_flight=3, num_running=10, num_waiting=4, kv_usage=0.5)
    assert view.load == 7
    with pytest.raises(ValueError, match="must be >= 0"):
        WorkerView("w", True, in_flight=-1)
