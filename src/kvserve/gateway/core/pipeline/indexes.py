"""The pipeline's prefix indexes: which blocks each worker is believed (`ApproxIndex`, from what
the gateway sent) or known (`ExactIndex`, from the worker's KV events) to cache."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvserve.gateway.core.pipeline.base import RouteRequest
from kvserve.gateway.core.pipeline.block_index import BlockIndex

MAX_BLOCKS_PER_WORKER = 65_536
"""About 4M tokens of character blocks per worker, ~2 MiB of hashes: a cap on memory. The index
should forget about when the worker does, so a worker whose KV capacity is known
(`set_worker_capacity`, from its /metrics) is indexed in at most that many tokens of blocks."""

EXACT_MAX_BLOCKS_PER_WORKER = 1 << 20
"""A safety cap far above any worker's block count: while a worker's cache fits, the exact index
is exact; past it (lost `removed` events), the oldest entries go first."""

DEFAULT_MAX_PENDING_BLOCKS_PER_WORKER = 4096


class ApproxIndex:
    """Per worker, the prefix blocks of the requests sent there (a bounded LRU). Approximate:
    a worker is assumed to cache what it was sent until the LRU forgets it, and the LRU holds
    no more than the worker can (`set_worker_capacity`): a worker that took every tenant while
    another was down kept only the most recent ones."""

    def __init__(self) -> None:
        self._indexes: dict[str, BlockIndex] = {}
        self._capacity_tokens: dict[str, int] = {}

    def num_matched(self, worker_id: str, prefix_hashes: Sequence[bytes]) -> int:
        index = self._indexes.get(worker_id)
        return index.num_matched(prefix_hashes) if index is not None else 0

    def observe(self, request: RouteRequest, worker_id: str) -> None:
        """The worker will cache the request's prefix: insert (or refresh) its blocks, in an
        index of at most the worker's capacity in this request's blocks."""
        capacity = self.capacity_blocks(worker_id, request.block_tokens)
        index = self._indexes.get(worker_id)
        if index is None:
            index = self._indexes[worker_id] = BlockIndex(capacity)
        elif index.capacity != capacity:
            index.resize(capacity)
        index.touch_chain(request.prefix_hashes)

    def set_worker_capacity(self, worker_id: str, kv_tokens: int) -> None:
        """The worker's KV cache holds `kv_tokens` tokens: from the next request sent to it,
        its index holds at most that many tokens of blocks. Raises ValueError below 1."""
        if kv_tokens < 1:
            raise ValueError(f"worker {worker_id!r}: a KV capacity must be >= 1 token, "
                             f"got {kv_tokens}")
        self._capacity_tokens[worker_id] = kv_tokens

    def remove_worker(self, worker_id: str) -> None:
        """Drop the worker's index (its capacity is kept: a restart keeps its configuration)."""
        self._indexes.pop(worker_id, None)

    def index_size(self, worker_id: str) -> int:
        """Blocks indexed for a worker (never above MAX_BLOCKS_PER_WORKER)."""
        index = self._indexes.get(worker_id)
        return len(index) if index is not None else 0

    def capacity_blocks(self, worker_id: str, block_tokens: int) -> int:
        """The most blocks of `block_tokens` the worker's index holds."""
        kv_tokens = self._capacity_tokens.get(worker_id)
        if kv_tokens is None:
            return MAX_BLOCKS_PER_WORKER
        return max(1, min(MAX_BLOCKS_PER_WORKER, kv_tokens // block_tokens))

    def has_room(self, worker_id: str, request: RouteRequest) -> bool:
        """Whether the request's whole chain fits beside what the index holds."""
        return (self.index_size(worker_id) + len(request.prefix_hashes)
                <= self.capacity_blocks(worker_id, request.block_tokens))


class ExactIndex:
    """Per worker, the block hashes its KV events say it caches (BlockStored / BlockRemoved /
    AllBlocksCleared), plus the blocks sent and not yet confirmed (pending, a small LRU), so a
    burst of one prefix does not scatter during a long prefill; events supersede pending. A
    worker whose stream is being resynchronised (`set_synced(worker, False)`) has an unknown
    index, not an empty one: its cached blocks count for nothing until synced again."""

    def __init__(self, max_blocks_per_worker: int = EXACT_MAX_BLOCKS_PER_WORKER,
                 max_pending_blocks_per_worker: int = DEFAULT_MAX_PENDING_BLOCKS_PER_WORKER
                 ) -> None:
        self.max_blocks_per_worker = max_blocks_per_worker
        self.max_pending_blocks_per_worker = max_pending_blocks_per_worker
        self._cached: dict[str, BlockIndex] = {}
        self._pending: dict[str, BlockIndex] = {}
        self._unsynced: set[str] = set()

    def set_synced(self, worker_id: str, synced: bool) -> None:
        """Whether the worker's index follows its events from a known state."""
        if synced:
            self._unsynced.discard(worker_id)
        else:
            self._unsynced.add(worker_id)

    def is_synced(self, worker_id: str) -> bool:
        return worker_id not in self._unsynced

    def apply_events(self, worker_id: str, stored: Iterable[bytes] = (),
                     removed: Iterable[bytes] = (), cleared: bool = False) -> None:
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

    def num_matched(self, worker_id: str, prefix_hashes: Sequence[bytes]) -> int:
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

    @staticmethod
    def _index(indexes: dict[str, BlockIndex], worker_id: str, capacity: int) -> BlockIndex:
        index = indexes.get(worker_id)
        if index is None:
            index = indexes[worker_id] = BlockIndex(capacity)
        return index
