"""The pool of physical KV blocks: allocation, release, eviction and the prefix-hash map.

The pool knows blocks, not requests. Its callers (the request-level manager) decide which blocks
a request holds; the pool keeps refcounts, the free queue and the hash map consistent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvserve.kvcache.block import KVBlock
from kvserve.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvserve.kvcache.free_queue import FreeBlockQueue
from kvserve.kvcache.stats import KVCacheCounters


class BlockPool:
    """`num_blocks` blocks of `block_size` slots, created once and reused forever.

    Contract: a block with `ref_cnt > 0` is never in the free queue and never evicted; a block in
    the hash map always carries that hash and the tokens it covers; allocation either hands out
    exactly what was asked or changes nothing. `on_evict`, if given, sees each evicted block
    with its content key still set, just before the block is handed to new content.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        counters: KVCacheCounters,
        *,
        enable_events: bool = False,
        on_evict: Callable[[KVBlock], None] | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.num_cached_free = 0  # free blocks that still carry a hash
        self.counters = counters
        self.enable_events = enable_events
        self.events: list[KVEvent] = []
        self.on_evict = on_evict

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def get_cached_block(self, block_hash: bytes, token_bytes: bytes) -> KVBlock | None:
        """The block caching exactly these tokens under this hash, or None. Read-only, except
        that a refused match is counted: tokens that differ (a hash collision), or a block handed
        to new content since it was cached (an eviction that left its key behind: corruption)."""
        block = self.cached.get(block_hash)
        if block is None:
            return None
        if block.token_bytes != token_bytes:
            self.counters.hash_collisions += 1
            return None
        if block.epoch != block.cached_epoch or block.block_hash != block_hash:
            self.counters.corruption_detections += 1
            return None
        return block

    def touch(self, blocks: Iterable[KVBlock], owner: str | None = None) -> None:
        """Take one more reference on each block, pulling free ones out of the free queue."""
        for block in blocks:
            block.last_owner = owner
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                if block.block_hash is not None:
                    self.num_cached_free -= 1
            block.ref_cnt += 1

    def allocate(self, num_blocks: int, owner: str | None = None) -> list[KVBlock] | None:
        """Hand out `num_blocks` fresh blocks (refcount 1, new epoch, no content key).

        Cached blocks taken from the head are evicted (their hash leaves the map). Returns None,
        changing nothing, when fewer than `num_blocks` blocks are free.
        """
        if num_blocks > self.free_queue.num_free_blocks:
            return None
        out = self.free_queue.popleft_n(num_blocks)
        for block in out:
            if block.block_hash is not None:
                self._evict(block)
            block.epoch += 1
            block.ref_cnt = 1
            block.last_owner = owner
        self.counters.allocated_blocks += num_blocks
        return out

    def _evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None and block.ref_cnt == 0, f"evicting held {block}"
        block_hash = block.block_hash
        if self.on_evict is not None:
            self.on_evict(block)
        if self.cached.get(block_hash) is block:
            del self.cached[block_hash]
        self.num_cached_free -= 1
        block.clear_content()
        self.counters.evicted_blocks += 1
        if self.enable_events:
            self.events.append(BlockRemoved((block_hash,)))

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block, in eviction-priority order (the caller passes a
        request's blocks deepest first). A block reaching zero joins the free queue: at the tail
        if it is cached, at the head if it holds nothing worth keeping."""
        freed = 0
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            freed += 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self.free_queue.append(block)
                    self.num_cached_free += 1
                else:
                    self.free_queue.appendleft(block)
        self.counters.freed_blocks += freed

    def cache_block(
        self,
        block: KVBlock,
        block_hash: bytes,
        parent_hash: bytes | None,
        token_ids: list[int],
        token_bytes: bytes,
        salt: str | None,
        adapter_digest: bytes | None = None,
    ) -> bool:
        """Make a held, fully written block hit-able under `block_hash`.

        Returns False (and leaves the block uncached) when another block already caches the same
        content: the map keeps one block per hash, so a hit can never see two.
        """
        assert block.ref_cnt > 0 and block.block_hash is None, f"caching {block}"
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        block.token_bytes = token_bytes
        block.salt = salt
        block.adapter_digest = adapter_digest
        block.cached_epoch = block.epoch
        self.cached[block_hash] = block
        if self.enable_events:
            self.events.append(
                BlockStored((block_hash,), parent_hash, tuple(token_ids), self.block_size, salt,
                            adapter_digest)
            )
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (False) while any block is held, because a held
        block's hash is what a running request's later commits chain from."""
        if self.free_queue.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            if block.block_hash is not None:
                block.clear_content()
                block.epoch += 1
        self.cached.clear()
        self.num_cached_free = 0
        if self.enable_events:
            self.events.append(AllBlocksCleared())
        return True

    def drain_events(self) -> list[KVEvent]:
        """Events since the last drain, oldest first."""
        events, self.events = self.events, []
        return events
