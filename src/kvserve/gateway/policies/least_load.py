"""Least load by the power of two choices: two random healthy workers, the less loaded wins."""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvserve.gateway.policies.base import (
    Branch,
    RouteDecision,
    RouteRequest,
    WorkerView,
    healthy_workers,
)


def _by_load(worker: WorkerView) -> tuple[int, str]:
    return worker.load, worker.worker_id


class LeastLoadPolicy:
    """Power of two choices (Mitzenmacher): nearly the balance of a full scan, without every
    replica herding onto the same momentarily idle worker. The RNG is injected (`rng`, or a
    `seed`), so a seeded run is reproducible; ties go to the lower load, then the lower id."""

    name = "least_load"
    replica_safe = True  # no index: nothing replicas could learn apart

    def __init__(self, *, rng: random.Random | None = None, seed: int = 0) -> None:
        self._rng = rng if rng is not None else random.Random(seed)

    def route(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RouteDecision:
        """The less loaded of two sampled healthy workers; fallbacks: the other, then the rest
        by load."""
        healthy = healthy_workers(workers)
        if len(healthy) == 1:
            return RouteDecision(healthy[0].worker_id, Branch.LEAST_LOAD, (healthy[0].worker_id,))
        pair = sorted(self._rng.sample(healthy, 2), key=_by_load)
        chosen_ids = {w.worker_id for w in pair}
        rest = sorted((w for w in healthy if w.worker_id not in chosen_ids), key=_by_load)
        ranked = tuple(w.worker_id for w in pair + rest)
        return RouteDecision(ranked[0], Branch.LEAST_LOAD, ranked)

    def observe(self, request: RouteRequest, worker_id: str) -> None:
        """Nothing to learn: load arrives with the worker views."""

    def remove_worker(self, worker_id: str) -> None:
        """Nothing to forget."""
