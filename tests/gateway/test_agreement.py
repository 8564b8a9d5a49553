"""Two independent policy instances fed the same stream reach the same decisions.

For prefix_hash this is what lets gateway replicas agree with no shared state; for the indexed
policies it holds for replicas that see the same stream (and the same KV events); and every
policy ignores the order in which a caller happens to list the fleet.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.gateway.core.pipeline import (
    POLICY_NAMES,
    PrecisePolicy,
    RouteRequest,
    RoutingPolicy,
    WorkerView,
    make_policy,
)
from tests.gateway.helpers import request

WORKER_IDS = [f"w{i}" for i in range(5)]


@dataclass(frozen=True)
class Step:
    request: RouteRequest
    workers: tuple[WorkerView, ...]
    stored: tuple[bytes, ...]  # KV events for `precise`: blocks the chosen worker now caches
    evicted: tuple[bytes, ...]


@st.composite
def steps(draw: st.DrawFn) -> Step:
    text = draw(st.sampled_from(["alpha", "beta", "gamma", "delta"])) * draw(st.integers(1, 12))
    req = request(text, draw(st.sampled_from([None, "t1", "t2"])))
    workers = tuple(
        WorkerView(
            wid,
            healthy=draw(st.booleans()) or wid == "w0",
            in_flight=draw(st.integers(0, 6)),
            num_waiting=draw(st.integers(0, 3)),
        )
        for wid in WORKER_IDS
    )
    num_stored = draw(st.integers(0, len(req.prefix_hashes)))
    evicted = req.prefix_hashes[draw(st.integers(0, len(req.prefix_hashes))) :]
    return Step(req, workers, req.prefix_hashes[:num_stored], evicted)


def replay(policy: RoutingPolicy, stream: list[Step], shuffle_seed: int | None) -> list[object]:
    rng = random.Random(shuffle_seed)
    out: list[object] = []
    for step in stream:
        workers = list(step.workers)
        if shuffle_seed is not None:
            rng.shuffle(workers)
        decision = policy.route(step.request, workers)
        policy.observe(step.request, decision.worker_id)
        if isinstance(policy, PrecisePolicy):
            policy.apply_events(decision.worker_id, stored=step.stored)
            policy.apply_events(WORKER_IDS[len(out) % 5], removed=step.evicted)
        out.append(decision)
    return out


@settings(max_examples=40, deadline=None)
@given(st.lists(steps(), min_size=1, max_size=40), st.integers(0, 2**32))
def test_two_instances_agree_on_every_decision(stream: list[Step], shuffle_seed: int) -> None:
    for name in POLICY_NAMES:
        first = replay(make_policy(name), stream, None)
        second = replay(make_policy(name), stream, shuffle_seed)
        assert first == second, name


def test_prefix_hash_replicas_agree_without_seeing_each_others_traffic() -> None:
    """Replicas behind a round-robin balancer each see a different share of the stream; with
    the same worker views they still pick the same worker for every request."""
    replicas = [make_policy("prefix_hash") for _ in range(3)]
    rng = random.Random(0)
    for i in range(300):
        req = request(f"tenant prompt {rng.randrange(40)} " * 4, f"t{rng.randrange(5)}")
        fleet = [WorkerView(w, True, in_flight=rng.randrange(4)) for w in WORKER_IDS]
        answers = {r.route(req, fleet) for r in replicas}
        assert len(answers) == 1
        replicas[i % 3].observe(req, answers.pop().worker_id)
