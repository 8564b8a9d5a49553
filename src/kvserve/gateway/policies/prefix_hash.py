"""Rendezvous hashing of tenant + prefix with bounded load: stateless, replica-consistent
affinity that cannot build a hot spot."""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvserve.gateway.policies.base import (
    Branch,
    RouteDecision,
    RouteRequest,
    WorkerView,
    healthy_workers,
)
from kvserve.gateway.policies.rendezvous import (
    DEFAULT_PREFIX_BLOCKS,
    rendezvous_key,
    rendezvous_order,
)

DEFAULT_LOAD_FACTOR = 1.25


def load_bound(total_load: int, num_workers: int, load_factor: float) -> int:
    """Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam): a worker may take
    a new request only while its load is below ceil(c * (total_load + 1) / n). With c >= 1 some
    worker always qualifies, and the one chosen ends at or below the bound."""
    # Rounded first so that float noise (1.1 * 10 = 11.000000000000002) cannot add a slot.
    return math.ceil(round(load_factor * (total_load + 1) / num_workers, 9))


class PrefixHashPolicy:
    """Each (tenant, first `prefix_blocks` prefix hashes) has a fixed preference order over
    worker ids (rendezvous hashing); the request goes to the first worker in that order whose
    load is under `load_bound`, spilling down the order otherwise. Keeps no state: every gateway
    replica that sees the same workers and loads picks the same worker. A request with no full
    prefix block goes to the least loaded worker (ties in the tenant's rendezvous order)."""

    name = "prefix_hash"
    replica_safe = True  # a hash of the request and the worker list only

    def __init__(
        self,
        *,
        prefix_blocks: int = DEFAULT_PREFIX_BLOCKS,
        load_factor: float = DEFAULT_LOAD_FACTOR,
    ) -> None:
        if prefix_blocks < 1:
            raise ValueError(f"prefix_blocks must be >= 1, got {prefix_blocks}")
        if not load_factor >= 1.0:
            raise ValueError(f"load_factor must be >= 1.0 (1.0: no slack), got {load_factor}")
        self.prefix_blocks = prefix_blocks
        self.load_factor = load_factor

    def route(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RouteDecision:
        """The first worker in the prefix's rendezvous order that is under the load bound;
        fallbacks: the other workers under the bound, then those over it, in rendezvous order."""
        # Invariant: the chosen worker's load + 1 <= load_bound(total + 1 request, n, c).
        healthy = healthy_workers(workers)
        key = rendezvous_key(request.tenant, request.prefix_hashes, self.prefix_blocks)
        order = rendezvous_order(key, healthy)
        if not request.prefix_hashes:
            order.sort(key=lambda w: w.load)  # stable: equal loads keep the rendezvous order
            ranked = tuple(w.worker_id for w in order)
            return RouteDecision(ranked[0], Branch.LEAST_LOAD, ranked)
        bound = load_bound(sum(w.load for w in healthy), len(healthy), self.load_factor)
        under = [w.worker_id for w in order if w.load < bound]
        over = [w.worker_id for w in order if w.load >= bound]
        assert under, "with load_factor >= 1 some worker is always under the bound"
        branch = Branch.AFFINITY if under[0] == order[0].worker_id else Branch.SPILL
        return RouteDecision(under[0], branch, tuple(under + over))

    def observe(self, request: RouteRequest, worker_id: str) -> None:
        """Nothing to learn: the policy is stateless."""

    def remove_worker(self, worker_id: str) -> None:
        """Nothing to forget: a removed worker simply stops appearing in `workers`."""
