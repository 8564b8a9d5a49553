"""Pipeline filters: which workers may take a request at all."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvserve.gateway.core.pipeline.base import RouteRequest, WorkerView, healthy_workers


class Healthy:
    """The healthy workers sorted by id, so a decision never depends on the order a caller
    lists the fleet in; raises NoHealthyWorker when there are none."""

    def filter(self, request: RouteRequest, workers: Sequence[WorkerView]) -> list[WorkerView]:
        return healthy_workers(workers)


class Role:
    """The workers of one role (disaggregated serving: the prefill or the decode pool)."""

    def __init__(self, worker_ids: Collection[str]) -> None:
        self.worker_ids = frozenset(worker_ids)

    def filter(self, request: RouteRequest, workers: Sequence[WorkerView]) -> list[WorkerView]:
        return [w for w in workers if w.worker_id in self.worker_ids]
