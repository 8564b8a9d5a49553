"""The routing pipeline: filters -> order -> weighted scorers -> picker, each a small object.

Every policy is a named configuration of one `Pipeline` (`round_robin.py` ... `precise.py`):
filters drop workers that may not take the request (`filters.py`); an order ranks the rest
before scoring, so equal scores keep it (`RendezvousOrder`); a prefix index says how many of the
request's blocks each worker holds (`indexes.py`); weighted scorers turn that and the loads into
one number per worker (`scorers.py`); a picker chooses (`pickers.py`). Adding a signal (say
adapter affinity) is one `Scorer` class and one line in a configuration's scorer list.

Pure, as every policy: no HTTP, asyncio or clock; what changes over time arrives in the views.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from kvserve.gateway.core.pipeline.base import RouteDecision, RouteRequest, WorkerView
from kvserve.gateway.core.pipeline.indexes import ExactIndex


class Filter(Protocol):
    """Drops workers that may not take the request; raises NoHealthyWorker when none may."""

    def filter(self, request: RouteRequest, workers: Sequence[WorkerView]) -> list[WorkerView]:
        ...


class Order(Protocol):
    """Ranks the candidates before scoring (a stable order every replica computes alike)."""

    def order(self, request: RouteRequest, workers: Sequence[WorkerView]) -> list[WorkerView]:
        ...


class PrefixIndex(Protocol):
    """What each worker caches of a request's prefix, as far as the gateway can tell; learns
    from the requests it is sent (`observe`) and forgets a worker that left."""

    def num_matched(self, worker_id: str, prefix_hashes: Sequence[bytes]) -> int:
        """Leading blocks of the chain the worker holds (read-only)."""
        ...

    def observe(self, request: RouteRequest, worker_id: str) -> None: ...

    def remove_worker(self, worker_id: str) -> None: ...


class Scorer(Protocol):
    """One weighted term of a worker's score, signed (a cost is negative), per candidate in
    order. `hits`: the index's matched blocks per worker (empty without an index)."""

    def score(self, request: RouteRequest, workers: Sequence[WorkerView],
              hits: Mapping[str, int]) -> list[float]:
        ...


class Picker(Protocol):
    """Chooses among ordered candidates from their summed scores and prefix hits."""

    def pick(self, request: RouteRequest, workers: list[WorkerView], hits: Mapping[str, int],
             scores: Sequence[float]) -> RouteDecision:
        ...


class Pipeline:
    """One routing policy: `filters`, then `order`, then `scorers` summed, then `picker`;
    `index` (when the policy keeps one) learns what is sent and what a worker holds.
    Deterministic given its configuration and the sequence of calls."""

    name = "pipeline"
    replica_safe = True

    def __init__(self, *, filters: Sequence[Filter], picker: Picker, order: Order | None = None,
                 index: PrefixIndex | None = None, scorers: Sequence[Scorer] = ()) -> None:
        self.filters = tuple(filters)
        self.order = order
        self.index = index
        self.scorers = tuple(scorers)
        self.picker = picker

    def route(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RouteDecision:
        """Choose a worker; raises NoHealthyWorker when the filters leave none. Changes no
        index: call `observe` when the request is sent."""
        # Invariant: each stage sees only what the stages before it let through.
        candidates = list(workers)
        for stage in self.filters:
            candidates = stage.filter(request, candidates)
        if self.order is not None:
            candidates = self.order.order(request, candidates)
        index = self.index
        hits = ({w.worker_id: index.num_matched(w.worker_id, request.prefix_hashes)
                 for w in candidates} if index is not None else {})
        totals = [0.0] * len(candidates)
        for scorer in self.scorers:
            # Summed term by term in the configuration's order: a - b is a + (-b) exactly.
            totals = [t + s for t, s in zip(totals, scorer.score(request, candidates, hits),
                                            strict=True)]
        return self.picker.pick(request, candidates, hits, totals)

    @property
    def event_index(self) -> ExactIndex | None:
        """The index the workers' KV events feed, when this pipeline scores by one (the
        gateway then follows the workers' events into it)."""
        return self.index if isinstance(self.index, ExactIndex) else None

    def observe(self, request: RouteRequest, worker_id: str) -> None:
        """The request was sent to `worker_id`: the index (if any) learns it."""
        if self.index is not None:
            self.index.observe(request, worker_id)

    def remove_worker(self, worker_id: str) -> None:
        """Forget everything about a worker that left the fleet."""
        if self.index is not None:
            self.index.remove_worker(worker_id)
