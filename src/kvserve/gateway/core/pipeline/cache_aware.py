"""Cache-aware routing from an approximate per-worker prefix index, scored continuously."""

from __future__ import annotations

from kvserve.gateway.core.pipeline.adapter_affinity import (
    DEFAULT_ADAPTER_WEIGHT,
    AdapterAffinity,
    AdapterOrder,
)
from kvserve.gateway.core.pipeline.base import Branch
from kvserve.gateway.core.pipeline.filters import Healthy
from kvserve.gateway.core.pipeline.indexes import MAX_BLOCKS_PER_WORKER, ApproxIndex
from kvserve.gateway.core.pipeline.pickers import BestScore, BoundedLoad
from kvserve.gateway.core.pipeline.pipeline import Pipeline
from kvserve.gateway.core.pipeline.prefix_hash import COLD_LOAD_FACTOR
from kvserve.gateway.core.pipeline.rendezvous import DEFAULT_PREFIX_BLOCKS, RendezvousOrder
from kvserve.gateway.core.pipeline.scorers import (
    DEFAULT_BACKLOG_WEIGHT,
    DEFAULT_BLOCK_CREDIT,
    DEFAULT_FOOTPRINT_WEIGHT,
    DEFAULT_LOAD_WEIGHT,
    Backlog,
    Footprint,
    Load,
    PrefixHits,
    check_weights,
)

__all__ = ["COLD_PLACEMENTS", "MAX_BLOCKS_PER_WORKER", "CacheAwarePolicy"]

COLD_PLACEMENTS = ("rendezvous", "footprint")
"""Where `cache_aware` sends a prefix its index holds on no worker. `rendezvous` (the default):
`prefix_hash`'s choice, the first worker in the prefix's rendezvous order under the load bound,
passing over one whose index is full while another has room; every gateway replica makes it
alike, so replicas that each learn only their own traffic still place a tenant on one worker.
`footprint`: the emptiest index, load and prefill backlog weighed in; only this gateway knows
its index, so replicas place a tenant apart, while one gateway keeps cold prefills apart
(docs/operations.md says when to choose it). `footprint_weight` weighs only in `footprint`
placement."""

class CacheAwarePolicy(Pipeline):
    """Healthy -> rendezvous order -> prefix hits from an approximate index of what was sent
    (`indexes.ApproxIndex`), load, prefill backlog and (with `cold_placement="footprint"`)
    index footprint, weighted -> the best score (`pickers.BestScore`), a prefix nobody holds
    going where `cold_placement` says. Two instances fed the same calls agree; replicas each
    learn their own traffic, and agree on where a new prefix goes unless
    `cold_placement="footprint"` (`replica_safe`). A request under a LoRA adapter also scores
    where its adapter is loaded (`adapter_affinity.AdapterAffinity`, `adapter_weight`; 0: not
    at all), and a prefix nobody holds goes first where its adapter runs
    (`adapter_affinity.AdapterOrder`)."""

    name = "cache_aware"

    def __init__(
        self,
        *,
        block_credit: float = DEFAULT_BLOCK_CREDIT,
        load_weight: float = DEFAULT_LOAD_WEIGHT,
        footprint_weight: float = DEFAULT_FOOTPRINT_WEIGHT,
        backlog_weight: float = DEFAULT_BACKLOG_WEIGHT,
        cold_placement: str = "rendezvous",
        adapter_weight: float = DEFAULT_ADAPTER_WEIGHT,
    ) -> None:
        """docs/operations.md ("Routing and admission options") says what each option does
        and its measured effect."""
        if cold_placement not in COLD_PLACEMENTS:
            raise ValueError(f"cold_placement must be one of {', '.join(COLD_PLACEMENTS)}, "
                             f"got {cold_placement!r}")
        check_weights(block_credit, load_weight, footprint_weight, backlog_weight)
        self.cold_placement = cold_placement
        self.backlog_weight = backlog_weight
        self.adapter_weight = adapter_weight
        adapters = AdapterAffinity(adapter_weight)
        self.footprint_weight = footprint_weight
        self.block_credit = block_credit
        self.load_weight = load_weight
        index = self.approx = ApproxIndex()
        by_rendezvous = cold_placement == "rendezvous"
        super().__init__(
            filters=[Healthy()],
            order=(AdapterOrder(RendezvousOrder(DEFAULT_PREFIX_BLOCKS)) if adapter_weight > 0
                   else RendezvousOrder(DEFAULT_PREFIX_BLOCKS)),
            index=index,
            scorers=[PrefixHits(block_credit), Load(load_weight),
                     Backlog(backlog_weight, block_credit), adapters,
                     *([] if by_rendezvous else [Footprint(footprint_weight, index)])],
            picker=BestScore(Branch.AFFINITY, cold=BoundedLoad(COLD_LOAD_FACTOR, room=index)
                             if by_rendezvous else None),
        )

    @property
    def replica_safe(self) -> bool:  # type: ignore[override]
        """Whether replicas, each learning only its own traffic, still send a tenant to one
        worker: yes when a new prefix goes where every replica puts it (rendezvous)."""
        return self.cold_placement == "rendezvous"

    def set_worker_capacity(self, worker_id: str, kv_tokens: int) -> None:
        """The worker's KV cache holds `kv_tokens` tokens (its `vllm:cache_config_info`)
        (`indexes.ApproxIndex.set_worker_capacity`)."""
        self.approx.set_worker_capacity(worker_id, kv_tokens)

    def index_size(self, worker_id: str) -> int:
        """Blocks indexed for a worker (never above MAX_BLOCKS_PER_WORKER)."""
        return self.approx.index_size(worker_id)
