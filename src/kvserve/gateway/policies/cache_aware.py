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
from kvserve.gateway.policies.prefix_hash import PrefixHashPolicy
from kvserve.gateway.policies.rendezvous import DEFAULT_PREFIX_BLOCKS
from kvserve.gateway.policies.scoring import (
    DEFAULT_BACKLOG_WEIGHT,
    DEFAULT_BLOCK_CREDIT,
    DEFAULT_FOOTPRINT_WEIGHT,
    DEFAULT_LOAD_WEIGHT,
    check_weights,
    score_route,
)

COLD_PLACEMENTS = ("rendezvous", "footprint")
"""Where `cache_aware` sends a prefix its index holds on no worker. `rendezvous` (the default):
`prefix_hash`'s choice, the first worker in the prefix's rendezvous order under the load bound,
passing over one whose index is full while another has room; every gateway replica makes it
alike, so replicas that each learn only their own traffic still place a tenant on one worker.
`footprint`: the emptiest index, load and prefill backlog weighed in; only this gateway knows
its index, so replicas place a tenant apart, while one gateway keeps cold prefills apart
(docs/operations.md says when to choose it). `footprint_weight` weighs only in `footprint`
placement."""

MAX_BLOCKS_PER_WORKER = 65_536
"""About 4M tokens of character blocks per worker, ~2 MiB of hashes: a cap on memory. The index
should forget about when the worker does, so a worker whose KV capacity is known
(`set_worker_capacity`, from its /metrics) is indexed in at most that many tokens of blocks."""


class CacheAwarePolicy:
    """Remembers, per worker, the prefix blocks of the requests it sent there (a bounded LRU,
    `max_blocks_per_worker`), and routes by `scoring.score_route`: cached-prefix credit against
    load, continuously, a prefix nobody holds going where `cold_placement` says. Approximate: it
    assumes a worker caches what it was sent until the LRU forgets it, and the LRU holds no more
    than the worker can (`set_worker_capacity`): a worker that took every tenant while another
    was down kept only the most recent ones, and the rest must not stay pinned to it when the
    other comes back. Two instances fed the same calls agree; replicas each learn their own
    traffic, and agree on where a new prefix goes unless `cold_placement="footprint"`
    (`replica_safe`)."""

    name = "cache_aware"

    def __init__(
        self,
        *,
        block_credit: float = DEFAULT_BLOCK_CREDIT,
        load_weight: float = DEFAULT_LOAD_WEIGHT,
        footprint_weight: float = DEFAULT_FOOTPRINT_WEIGHT,
        backlog_weight: float = DEFAULT_BACKLOG_WEIGHT,
        cold_placement: str = "rendezvous",
    ) -> None:
        """docs/operations.md ("Routing and admission options") says what each option does
        and its measured effect."""
        if cold_placement not in COLD_PLACEMENTS:
            raise ValueError(f"cold_placement must be one of {', '.join(COLD_PLACEMENTS)}, "
                             f"got {cold_placement!r}")
        self.cold_placement = cold_placement
        self._rendezvous = PrefixHashPolicy()
        check_weights(block_credit, load_weight, footprint_weight, backlog_weight)
        self.backlog_weight = backlog_weight
        self.footprint_weight = footprint_weight
        self.block_credit = block_credit
        self.load_weight = load_weight
        self._indexes: dict[str, BlockIndex] = {}
        self._capacity_tokens: dict[str, int] = {}

    def route(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RouteDecision:
        """The healthy worker with the best score; changes no index."""
        return score_route(
            request,
            healthy_workers(workers),
            lambda worker_id: self._num_matched(worker_id, request.prefix_hashes),
            block_credit=self.block_credit,
            load_weight=self.load_weight,
            prefix_blocks=DEFAULT_PREFIX_BLOCKS,
            hit_branch=Branch.AFFINITY,
            footprint=self.index_size,
            footprint_weight=self.footprint_weight,
            backlog_weight=self.backlog_weight,
            place_cold=self._place_by_rendezvous if self.replica_safe else None,
        )

    def _place_by_rendezvous(self, request: RouteRequest,
                             workers: Sequence[WorkerView]) -> RouteDecision:
        """`prefix_hash`'s choice, passing over a worker whose index is full (it would evict
        another prefix for this one) while another has room: few tenants hash unevenly."""
        decision = self._rendezvous.route(request, workers)
        needed = len(request.prefix_hashes)
        with_room = [w for w in decision.ranked if self.index_size(w) + needed
                     <= self._capacity_blocks(w, request.block_tokens)]
        if not with_room or with_room[0] == decision.worker_id:
            return decision
        chosen = with_room[0]
        return RouteDecision(chosen, decision.branch,
                             (chosen, *(w for w in decision.ranked if w != chosen)))

    @property
    def replica_safe(self) -> bool:
        """Whether replicas, each learning only its own traffic, still send a tenant to one
        worker: yes when a new prefix goes where every replica puts it (rendezvous)."""
        return self.cold_placement == "rendezvous"

    def observe(self, request: RouteRequest, worker_id: str) -> None:
        """The worker will cache the request's prefix: insert (or refresh) its blocks, in an
        index of at most the worker's capacity in this request's blocks."""
        capacity = self._capacity_blocks(worker_id, request.block_tokens)
        index = self._indexes.get(worker_id)
        if index is None:
            index = self._indexes[worker_id] = BlockIndex(capacity)
        elif index.capacity != capacity:
            index.resize(capacity)
        index.touch_chain(request.prefix_hashes)

    def set_worker_capacity(self, worker_id: str, kv_tokens: int) -> None:
        """The worker's KV cache holds `kv_tokens` tokens (its `vllm:cache_config_info`): from
        the next request sent to it (`observe`, which knows the key's block size), its index
        holds at most that many tokens of blocks, the least recent forgotten first. Raises
        ValueError for a capacity below one token."""
        if kv_tokens < 1:
            raise ValueError(f"worker {worker_id!r}: a KV capacity must be >= 1 token, "
                             f"got {kv_tokens}")
        self._capacity_tokens[worker_id] = kv_tokens

    def remove_worker(self, worker_id: str) -> None:
        """Drop the worker's index (its capacity is kept: a restart keeps its configuration,
        and a new one arrives through `set_worker_capacity`)."""
        self._indexes.pop(worker_id, None)

    def index_size(self, worker_id: str) -> int:
        """Blocks indexed for a worker (never above MAX_BLOCKS_PER_WORKER)."""
        index = self._indexes.get(worker_id)
        return len(index) if index is not None else 0

    def _capacity_blocks(self, worker_id: str, block_tokens: int) -> int:
        kv_tokens = self._capacity_tokens.get(worker_id)
        if kv_tokens is None:
            return MAX_BLOCKS_PER_WORKER
        return max(1, min(MAX_BLOCKS_PER_WORKER, kv_tokens // block_tokens))

    def _num_matched(self, worker_id: str, prefix_hashes: Sequence[bytes]) -> int:
        index = self._indexes.get(worker_id)
        return index.num_matched(prefix_hashes) if index is not None else 0
