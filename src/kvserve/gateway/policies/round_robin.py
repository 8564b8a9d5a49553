"""Round robin over the healthy workers: the baseline that thrashes prefix caches."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.gateway.policies.base import (
    Branch,
    RouteDecision,
    RouteRequest,
    WorkerView,
    healthy_workers,
)


class RoundRobinPolicy:
    """Each call takes the next healthy worker in id order. Two instances fed the same calls
    agree; replicas behind a balancer do not (each keeps its own counter)."""

    name = "round_robin"
    replica_safe = True  # no index: nothing replicas could learn apart

    def __init__(self) -> None:
        self._num_routed = 0

    def route(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RouteDecision:
        """The next healthy worker; the rest follow in rotation as fallbacks."""
        healthy = healthy_workers(workers)
        start = self._num_routed % len(healthy)
        self._num_routed += 1
        ranked = tuple(w.worker_id for w in healthy[start:] + healthy[:start])
        return RouteDecision(ranked[0], Branch.ROUND_ROBIN, ranked)

    def observe(self, request: RouteRequest, worker_id: str) -> None:
        """Nothing to learn."""

    def remove_worker(self, worker_id: str) -> None:
        """Nothing to forget."""
