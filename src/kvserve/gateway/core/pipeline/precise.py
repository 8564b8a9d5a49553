"""Precise routing from an exact per-worker index of cached blocks, fed by KV events."""

from __future__ import annotations

from collections.abc import Iterable

from kvserve.gateway.core.pipeline.adapter_affinity import (
    DEFAULT_ADAPTER_WEIGHT,
    AdapterAffinity,
    AdapterOrder,
)
from kvserve.gateway.core.pipeline.base import Branch
from kvserve.gateway.core.pipeline.filters import Healthy
from kvserve.gateway.core.pipeline.indexes import (
    DEFAULT_MAX_PENDING_BLOCKS_PER_WORKER,
    EXACT_MAX_BLOCKS_PER_WORKER,
    ExactIndex,
)
from kvserve.gateway.core.pipeline.pickers import BestScore, BoundedLoad
from kvserve.gateway.core.pipeline.pipeline import Pipeline
from kvserve.gateway.core.pipeline.prefix_hash import COLD_LOAD_FACTOR
from kvserve.gateway.core.pipeline.rendezvous import DEFAULT_PREFIX_BLOCKS, RendezvousOrder
from kvserve.gateway.core.pipeline.scorers import (
    DEFAULT_BACKLOG_WEIGHT,
    DEFAULT_BLOCK_CREDIT,
    DEFAULT_LOAD_WEIGHT,
    Backlog,
    Load,
    PrefixHits,
    check_weights,
)


class PrecisePolicy(Pipeline):
    """Knows exactly which block hashes each worker caches, from the worker's KV events
    (`apply_events`: BlockStored / BlockRemoved / AllBlocksCleared; `indexes.ExactIndex`), and
    routes through the pipeline `cache_aware` uses: healthy -> rendezvous order -> prefix hits,
    load, backlog and adapter affinity (a LoRA request, `adapter_weight`), weighted -> the best
    score.

    Requires the gateway to hash prompts exactly as the worker does: token ids from the worker's
    tokenizer and chat template, the worker's block size, model id and the tenant's cache salt
    folded into the first block (`kvserve.gateway.core.prefix.engine_block_hashes`, or
    `RouteKey.from_token_ids`). Character-block keys never match an event.

    Between sending a request and the worker's BlockStored for it (a long prefill), the sent
    prefix counts as pending (`observe`, a small LRU per worker), so a burst of one prefix does
    not scatter; events supersede it. `max_pending_blocks_per_worker=0` disables this.

    A prefix no worker holds goes in its rendezvous order (`prefix_hash`'s choice, under the
    load bound): replicas share the workers' events but not what each of them sent and is still
    pending, so only an order they all compute alike keeps a new tenant on one worker.

    A worker whose event stream is being resynchronised (`set_synced(worker, False)`: joined
    late, restarted, lost events) has an unknown index, not an empty one: until it is synced
    again its cached blocks count for nothing (only its pending ones do).
    """

    name = "precise"
    replica_safe = True  # the same events, and new prefixes in the same rendezvous order

    def __init__(
        self,
        *,
        block_credit: float = DEFAULT_BLOCK_CREDIT,
        load_weight: float = DEFAULT_LOAD_WEIGHT,
        max_pending_blocks_per_worker: int = DEFAULT_MAX_PENDING_BLOCKS_PER_WORKER,
        backlog_weight: float = DEFAULT_BACKLOG_WEIGHT,
        adapter_weight: float = DEFAULT_ADAPTER_WEIGHT,
    ) -> None:
        check_weights(block_credit, load_weight, backlog_weight=backlog_weight)
        if max_pending_blocks_per_worker < 0:
            raise ValueError("max_pending_blocks_per_worker must be >= 0 (0: no pending "
                             f"blocks), got {max_pending_blocks_per_worker}")
        self.backlog_weight = backlog_weight
        self.adapter_weight = adapter_weight
        adapters = AdapterAffinity(adapter_weight)
        self.block_credit = block_credit
        self.load_weight = load_weight
        self.max_pending_blocks_per_worker = max_pending_blocks_per_worker
        index = self.exact = ExactIndex(EXACT_MAX_BLOCKS_PER_WORKER,
                                        max_pending_blocks_per_worker)
        super().__init__(
            filters=[Healthy()],
            order=(AdapterOrder(RendezvousOrder(DEFAULT_PREFIX_BLOCKS)) if adapter_weight > 0
                   else RendezvousOrder(DEFAULT_PREFIX_BLOCKS)),
            index=index,
            scorers=[PrefixHits(block_credit), Load(load_weight),
                     Backlog(backlog_weight, block_credit), adapters],
            picker=BestScore(Branch.PRECISE_HIT, cold=BoundedLoad(COLD_LOAD_FACTOR)),
        )

    def set_synced(self, worker_id: str, synced: bool) -> None:
        """Whether the worker's index follows its events from a known state (class doc)."""
        self.exact.set_synced(worker_id, synced)

    def is_synced(self, worker_id: str) -> bool:
        return self.exact.is_synced(worker_id)

    def apply_events(self, worker_id: str, stored: Iterable[bytes] = (),
                     removed: Iterable[bytes] = (), cleared: bool = False) -> None:
        """`indexes.ExactIndex.apply_events`."""
        self.exact.apply_events(worker_id, stored, removed, cleared)

    def num_cached_blocks(self, worker_id: str) -> int:
        """Blocks the worker's events say it caches."""
        return self.exact.num_cached_blocks(worker_id)
