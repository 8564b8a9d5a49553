"""Cache-aware routing from an approximate per-worker prefix index, scored continuously."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.gateway.policies.base import (
    Branch,
    RouteDecision,
    RouteRequest,
    WorkerView,
    healthy_workers,
)
from kvserve.gateway.policies.block_index import BlockIndex
from kvserve.gateway.policies.rendezvous import DEFAULT_PREFIX_BLOCKS
from kvserve.gateway.policies.scoring import (
    DEFAULT_BACKLOG_WEIGHT,
    DEFAULT_BLOCK_CREDIT,
    DEFAULT_FOOTPRINT_WEIGHT,
    DEFAULT_LOAD_WEIGHT,
    check_weights,
    score_route,
)

DEFAULT_MAX_BLOCKS_PER_WORKER = 65_536
"""About 16M tokens of character blocks per worker, ~2 MiB of hashes: set it near a worker's KV
capacity in blocks, so the index forgets about when the worker does."""


class CacheAwarePolicy:
    """Remembers, per worker, the prefix blocks of the requests it sent there (a bounded LRU,
    `max_blocks_per_worker`), and routes by `scoring.score_route`: cached-prefix credit against
    load, continuously, a prefix nobody holds going to the emptiest index (score's footprint
    term). Approximate: it assumes a worker caches what it was sent until the LRU
    forgets it. Two instances fed the same calls agree; replicas each learn their own traffic."""

    name = "cache_aware"

    def __init__(
        self,
        *,
        max_blocks_per_worker: int = DEFAULT_MAX_BLOCKS_PER_WORKER,
        block_credit: float = DEFAULT_BLOCK_CREDIT,
        load_weight: float = DEFAULT_LOAD_WEIGHT,
        prefix_blocks: int = DEFAULT_PREFIX_BLOCKS,
        footprint_weight: float = DEFAULT_FOOTPRINT_WEIGHT,
        backlog_weight: float = DEFAULT_BACKLOG_WEIGHT,
    ) -> None:
        check_weights(block_credit, load_weight, footprint_weight, backlog_weight)
        self.backlog_weight = backlog_weight
        self.footprint_weight = footprint_weight
        if max_blocks_per_worker < 1:
            raise ValueError(f"max_blocks_per_worker must be >= 1, got {max_blocks_per_worker}")
        if prefix_blocks < 1:
            raise ValueError(f"prefix_blocks must be >= 1, got {prefix_blocks}")
        self.max_blocks_per_worker = max_blocks_per_worker
        self.block_credit = block_credit
        self.load_weight = load_weight
        self.prefix_blocks = prefix_blocks
        self._indexes: dict[str, BlockIndex] = {}

    def route(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RouteDecision:
        """The healthy worker with the best score; changes no index."""
        return score_route(
            request,
            healthy_workers(workers),
            lambda worker_id: self._num_matched(worker_id, request.prefix_hashes),
            block_credit=self.block_credit,
            load_weight=self.load_weight,
            prefix_blocks=self.prefix_blocks,
            hit_branch=Branch.AFFINITY,
            footprint=self.index_size,
            footprint_weight=self.footprint_weight,
            backlog_weight=self.backlog_weight,
        )

    def observe(self, request: RouteRequest, worker_id: str) -> None:
        """The worker will cache the request's prefix: insert (or refresh) its blocks."""
        index = self._indexes.get(worker_id)
        if index is None:
            index = self._indexes[worker_id] = BlockIndex(self.max_blocks_per_worker)
        index.touch_chain(request.prefix_hashes)

    def remove_worker(self, worker_id: str) -> None:
        """Drop the worker's index."""
        self._indexes.pop(worker_id, None)

    def index_size(self, worker_id: str) -> int:
        """Blocks indexed for a worker (never above `max_blocks_per_worker`)."""
        index = self._indexes.get(worker_id)
        return len(index) if index is not None else 0

    def _num_matched(self, worker_id: str, prefix_hashes: Sequence[bytes]) -> int:
        index = self._indexes.get(worker_id)
        return index.num_matched(prefix_hashes) if index is not None else 0
