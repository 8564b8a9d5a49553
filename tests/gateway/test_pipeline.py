"""The routing pipeline's stages compose: a policy is a configuration of them, and a new signal
(the next issue's adapter affinity) is one scorer class and one line in a configuration."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from kvserve.gateway.core.pipeline import (
    ApproxIndex,
    Backlog,
    BestScore,
    Branch,
    CacheAwarePolicy,
    Healthy,
    Load,
    NoHealthyWorker,
    Pipeline,
    PrefixHits,
    RendezvousOrder,
    Role,
    RouteRequest,
    WorkerView,
)
from tests.gateway.helpers import request, views


class Affinity:
    """A scorer the next issue could add: `bonus` for the workers that hold what the request
    names (here: its tenant), nothing for the rest."""

    def __init__(self, holders: Mapping[str, set[str]], bonus: float) -> None:
        self.holders, self.bonus = holders, bonus

    def score(self, request: RouteRequest, workers: Sequence[WorkerView],
              hits: Mapping[str, int]) -> list[float]:
        held = self.holders.get(request.tenant or "", set())
        return [self.bonus if w.worker_id in held else 0.0 for w in workers]


def cache_aware_with(*extra: Affinity) -> Pipeline:
    """cache_aware's configuration (footprint placement off), plus `extra` scorers."""
    index = ApproxIndex()
    return Pipeline(filters=[Healthy()], order=RendezvousOrder(), index=index,
                    scorers=[PrefixHits(1.0), Load(1.0), Backlog(0.25, 1.0), *extra],
                    picker=BestScore(Branch.AFFINITY))


def test_the_configuration_decides_alike_with_no_extra_scorer() -> None:
    """Without cold placement and footprint, cache_aware's pipeline scores every held prefix
    as the named policy does."""
    built, named = cache_aware_with(), CacheAwarePolicy()
    req = request("a shared system prompt " * 6, "acme")
    for policy in (built, named):
        policy.observe(req, "b")
    for loads in ({"a": 0, "b": 0, "c": 0}, {"a": 0, "b": 9, "c": 0}, {"a": 3, "b": 30, "c": 1}):
        assert built.route(req, views(loads)) == named.route(req, views(loads))


def test_one_more_scorer_steers_the_pick() -> None:
    req = request("a prompt nobody has sent yet " * 4, "acme")
    fleet = views({"a": 0, "b": 0, "c": 0})
    plain = cache_aware_with().route(req, fleet).worker_id
    other = next(w for w in "abc" if w != plain)
    steered = cache_aware_with(Affinity({"acme": {other}}, bonus=2.0)).route(req, fleet)
    assert steered.worker_id == other and steered.ranked[0] == other
    # Weighed against load like any other term: two requests of load outweigh the bonus.
    busy = views({"a": 0, "b": 0, "c": 0} | {other: 3})
    assert cache_aware_with(Affinity({"acme": {other}}, bonus=2.0)).route(req, busy) \
        .worker_id != other


def test_filters_run_first_and_an_empty_pool_is_no_healthy_worker() -> None:
    pipeline = Pipeline(filters=[Healthy(), Role({"b", "c"})], order=RendezvousOrder(),
                        scorers=[Load(1.0)], picker=BestScore(Branch.AFFINITY))
    req = request("x" * 64)
    assert pipeline.route(req, views({"a": 0, "b": 5, "c": 0})).worker_id == "c"
    assert set(pipeline.route(req, views({"a": 0, "b": 0, "c": 0})).ranked) == {"b", "c"}
    with pytest.raises(NoHealthyWorker):
        Pipeline(filters=[Healthy()], picker=BestScore(Branch.AFFINITY)).route(
            req, views({"a": 0}, unhealthy=["a"]))
