"""The write path of a request's blocks: all-or-nothing slot allocation, then commit.

`allocate_record_slots` checks capacity before it touches any block; on a request's first
allocation it takes the lookup's prefix hit (device blocks join the table; host and disk slots
get fresh blocks and scheduled loads) and announces the prompt blocks the request will write.
`commit_record` publishes full blocks once the model has written their KV, never earlier. The
manager's `allocate_slots` and `commit` wrap these with the request's record and the clock.
"""

from __future__ import annotations

from kvserve.kvcache.block import KVBlock
from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.imports import KVImports
from kvserve.kvcache.ledger import RequestRecord
from kvserve.kvcache.prefix_hits import TierSlots, claim_prefix_hit
from kvserve.kvcache.publishing import announce, publish, withdraw
from kvserve.kvcache.stats import KVCacheCounters
from kvserve.kvcache.transfers import TransferLedger
from kvserve.kvcache.types import PrefixHit


def allocate_record_slots(
    pool: BlockPool,
    transfers: TransferLedger | None,
    imports: KVImports | None,
    pending: dict[bytes, str],
    counters: KVCacheCounters,
    record: RequestRecord,
    num_new_tokens: int,
    prefix_hit: PrefixHit | None,
    enable_prefix_caching: bool,
) -> list[KVBlock] | None:
    """Room for `num_new_tokens` more tokens after those computed; returns the new blocks.
    None when there is not enough free space, and then nothing has changed: no refcount, queue
    position, map entry, pin or counter. Raises ValueError for a request swapped out, a hit
    offered after admission, or more tokens than the request has."""
    # Invariant: capacity is checked before any block is touched (all-or-nothing).
    request_id, block_size = record.request_id, pool.block_size
    if record.swap_slots and not record.block_table:
        raise ValueError(f"request {request_id!r} is swapped out; resume it with swap_in")
    hit_blocks: list[KVBlock] = []
    tier_slots: TierSlots = []
    if prefix_hit is not None and prefix_hit.num_tokens:
        if record.block_table:
            raise ValueError(f"request {request_id!r}: a prefix hit is only taken at admission")
        hit_blocks, tier_slots = claim_prefix_hit(pool, transfers, record, prefix_hit)
    num_hit_blocks = len(hit_blocks) + len(tier_slots)
    num_computed = record.num_computed_tokens + num_hit_blocks * block_size
    num_tokens = num_computed + num_new_tokens
    if num_tokens > len(record.token_ids) or num_new_tokens < 0:
        raise ValueError(
            f"request {request_id!r}: cannot allocate {num_new_tokens} new tokens after "
            f"{num_computed} computed; it has only {len(record.token_ids)} tokens"
        )
    num_needed = max(record.num_blocks_needed(num_tokens, block_size) - len(hit_blocks), 0)
    num_reclaimed_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
    if num_needed + num_reclaimed_hits > pool.num_free_blocks:
        return None

    is_admission = not record.block_table
    pool.touch(hit_blocks, request_id)
    # Pinned before the pool evicts (and offloads) anything; deepest first, so the chain's
    # head is the most recently used and a tier's LRU gives up its tail first.
    for slot, source in reversed(tier_slots):
        assert transfers is not None, "claimed above"
        transfers.tier(source).pin(slot)
    new_blocks = pool.allocate(num_needed, request_id)
    assert new_blocks is not None, "free count checked above"
    if is_admission and imports is not None:
        imports.release(request_id)  # its loads pin what it needs now
    for block in (*hit_blocks, *new_blocks):
        record.block_table.append(block)
        record.block_epochs.append(block.epoch)
    for offset, (slot, source) in enumerate(tier_slots):
        assert transfers is not None, "claimed above"
        transfers.load(request_id, len(hit_blocks) + offset, new_blocks[offset], slot, source)
        transfers.tier(source).counters.hit_blocks += 1
        transfers.tier(source).counters.hit_tokens += block_size
    if num_hit_blocks:
        record.num_computed_tokens = num_computed
        record.num_cached_tokens = num_computed
    if is_admission and enable_prefix_caching:
        counters.prefix_queries_tokens += len(record.token_ids)
        counters.prefix_hits_tokens += record.num_cached_tokens
    if enable_prefix_caching:
        # Loaded blocks are announced too: until published, a twin request waits for them.
        first = len(hit_blocks) if tier_slots else record.num_computed_tokens // block_size
        announce(pending, pool, record, first)
    return new_blocks


def commit_record(
    pool: BlockPool,
    pending: dict[bytes, str],
    counters: KVCacheCounters,
    record: RequestRecord,
    num_computed_tokens: int,
    enable_prefix_caching: bool,
) -> None:
    """The model has written KV for the record's first `num_computed_tokens` tokens: full
    blocks among them are published. Raises ValueError, changing nothing, for a count below
    the computed tokens or beyond the allocated slots or the tokens."""
    block_size = pool.block_size
    capacity = len(record.block_table) * block_size
    if not record.num_computed_tokens <= num_computed_tokens <= min(
        capacity, len(record.token_ids)
    ):
        raise ValueError(
            f"request {record.request_id!r}: commit of {num_computed_tokens} tokens is outside "
            f"[{record.num_computed_tokens}, {min(capacity, len(record.token_ids))}]"
        )
    first_new_full = record.num_computed_tokens // block_size
    num_full = num_computed_tokens // block_size
    record.num_computed_tokens = num_computed_tokens
    if record.pending_hashes:
        withdraw(pending, record, record.block_hashes[first_new_full:num_full])
    if not enable_prefix_caching or num_full <= first_new_full:
        return
    record.extend_hashes(num_full, block_size)
    for idx in range(first_new_full, num_full):
        block = record.block_table[idx]
        if block.block_hash is not None:
            # A prefix-hit block, already cached under this very hash. Any other hash is a
            # key left behind by a reuse: counted here, named by the audit, never hit (the
            # lookup refuses a block whose epoch moved on since it was cached).
            if block.block_hash != record.block_hashes[idx]:
                counters.corruption_detections += 1
            continue
        publish(pool, record, idx)
