"""Rendezvous hashing of tenant + prefix with bounded load: stateless, replica-consistent
affinity that cannot build a hot spot."""

from __future__ import annotations

from kvserve.gateway.core.pipeline.filters import Healthy
from kvserve.gateway.core.pipeline.pickers import BoundedLoad, load_bound
from kvserve.gateway.core.pipeline.pipeline import Pipeline
from kvserve.gateway.core.pipeline.rendezvous import DEFAULT_PREFIX_BLOCKS, RendezvousOrder

__all__ = ["COLD_LOAD_FACTOR", "DEFAULT_LOAD_FACTOR", "PrefixHashPolicy", "load_bound"]

# prefix_hash's bound: 2.0 won or tied 1.25 and 1.5 on every simulated mix (docs/operations.md).
DEFAULT_LOAD_FACTOR = 2.0
# The bound cache_aware and precise place a prefix no index holds under. A trade, measured in
# the simulator (docs/operations.md, constants): 1.0 answers more in time without adapters but
# undoes adapter affinity; 2.0 and up keep adapters together but answer fewer in time.
COLD_LOAD_FACTOR = 1.25


class PrefixHashPolicy(Pipeline):
    """Healthy -> rendezvous order of (tenant, first `prefix_blocks` prefix hashes) -> the
    first worker under the load bound (`pickers.BoundedLoad`). Keeps no state: every gateway
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
        super().__init__(filters=[Healthy()], order=RendezvousOrder(prefix_blocks),
                         picker=BoundedLoad(load_factor))
