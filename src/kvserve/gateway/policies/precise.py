"""Precise routing from an exact per-worker index of cached blocks, fed by KV events."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

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
    DEFAULT_LOAD_WEIGHT,
    check_weights,
    score_route,
)

DEFAULT_MAX_BLOCKS_PER_WORKER = 1 << 20
"""A safety cap far above any worker's block count: while a worker's cache fits, the index is
exact; past it (lost `removed` events), the oldest entries go first."""

DEFAULT_MAX_PENDING_BLOCKS_PER_WORKER = 4096


class PrecisePolicy:
    """Knows exactly which block hashes each worker caches, from the worker's KV events
    (`apply_events`: BlockStored / BlockRemoved / AllBlocksCleared), and routes by
    `scoring.score_route` like `cache_aware`.

    Requires the gateway to hash prompts exactly as the worker does: token ids from the worker's
    tokenizer and chat template, the worker's block size, model id and the tenant's cache salt
    folded into the first block (`kvserve.gateway.prefix.engine_block_hashes`, or
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
        prefix_blocks: int = DEFAULT_PREFIX_BLOCKS,
        max_blocks_per_worker: int = DEFAULT_MAX_BLOCKS_PER_WORKER,
        max_pending_blocks_per_worker: int = DEFAULT_MAX_PENDING_BLOCKS_PER_WORKER,
        backlog_weight: float = DEFAULT_BACKLOG_WEIGHT,
    ) -> None:
        check_weights(block_credit, load_weight, backlog_weight=backlog_weight)
        self.backlog_weight = backlog_weight
        if prefix_blocks < 1 or max_blocks_per_worker < 1 or max_pending_blocks_per_worker < 0:
            raise ValueError(
                "prefix_blocks and max_blocks_per_worker must be >= 1 and "
                f"max_pending_blocks_per_worker >= 0, got {prefix_blocks}, "
                f"{max_blocks_per_worker}, {max_pending_blocks_per_worker}"
            )
        self.block_credit = block_credit
        self.load_weight = load_weight
        self.prefix_blocks = prefix_blocks
        self.max_blocks_per_worker = max_blocks_per_worker
        self.max_pending_blocks_per_worker = max_pending_blocks_per_worker
        self._rendezvous = PrefixHashPolicy(prefix_blocks=prefix_blocks)
        self._cached: dict[str, BlockIndex] = {}
        self._pending: dict[str, BlockIndex] = {}
        self._unsynced: set[str] = set()

    def set_synced(self, worker_id: str, synced: bool) -> None:
        """Whether the worker's index follows its events from a known state (class doc)."""
        if synced:
            self._unsynced.discard(worker_id)
        else:
            self._unsynced.add(worker_id)

    def is_synced(self, worker_id: str) -> bool:
        return worker_id not in self._unsynced

    def apply_events(
        self,
        worker_id: str,
        stored: Iterable[bytes] = (),
        removed: Iterable[bytes] = (),
        cleared: bool = False,
    ) -> None:
        """Apply a worker's KV events, in this order: `cleared` (forget everything), `removed`,
        then `stored`. A caller whose batch mixes kinds out of that order applies it in runs."""
        cached = self._index(self._cached, worker_id, self.max_blocks_per_worker)
        pending = self._pending.get(worker_id)
        if cleared:
            cached.clear()
            if pending is not None:
                pending.clear()
        removed_hashes, stored_hashes = list(removed), list(stored)
        cached.remove(removed_hashes)
        if pending is not None:
            pending.remove(removed_hashes)
            pending.remove(stored_hashes)  # confirmed: the exact index holds them now
        # An event's hashes extend a chain root first; touching them as a chain keeps the LRU
        # cap (rarely reached) evicting tails first.
        cached.touch_chain(stored_hashes)

    def route(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RouteDecision:
        """The healthy worker with the best score; changes no index."""
        return score_route(
            request,
            healthy_workers(workers),
            lambda worker_id: self._num_matched(worker_id, request.prefix_hashes),
            block_credit=self.block_credit,
            load_weight=self.load_weight,
            prefix_blocks=self.prefix_blocks,
            hit_branch=Branch.PRECISE_HIT,
            backlog_weight=self.backlog_weight,
            place_cold=self._rendezvous.route,
        )

    def observe(self, request: RouteRequest, worker_id: str) -> None:
        """The worker is about to compute this prefix: count it as pending until events say."""
        if self.max_pending_blocks_per_worker == 0:
            return
        pending = self._index(self._pending, worker_id, self.max_pending_blocks_per_worker)
        pending.touch_chain(request.prefix_hashes)

    def remove_worker(self, worker_id: str) -> None:
        """Drop the worker's indexes (whether it is synced is its event follower's to say)."""
        self._cached.pop(worker_id, None)
        self._pending.pop(worker_id, None)

    def num_cached_blocks(self, worker_id: str) -> int:
        """Blocks the worker's events say it caches."""
        index = self._cached.get(worker_id)
        return len(index) if index is not None else 0

    def _num_matched(self, worker_id: str, prefix_hashes: Sequence[bytes]) -> int:
        # A chain's head may be cached while its tail is still pending: count through both.
        cached, pending = self._cached.get(worker_id), self._pending.get(worker_id)
        if worker_id in self._unsynced:
            cached = None
        for idx, block_hash in enumerate(prefix_hashes):
            if not (
                (cached is not None and block_hash in cached)
                or (pending is not None and block_hash in pending)
            ):
                return idx
        return len(prefix_hashes)

    @staticmethod
    def _index(indexes: dict[str, BlockIndex], worker_id: str, capacity: int) -> BlockIndex:
        index = indexes.get(worker_id)
        if index is None:
            index = indexes[worker_id] = BlockIndex(capacity)
        return index
