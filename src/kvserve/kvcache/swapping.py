"""Preemption by swapping: a running request's KV goes to host slots private to it, and back.

`start_swap_out` schedules copies of every block holding the request's computed tokens (the
partial last block and the blocks decoding wrote included) into SWAPPING host slots owned by the
request, then releases its device blocks (full committed ones stay cached on the device, as
after any free). The request stays in the ledger with its computed tokens and its `swap_slots`.
`start_swap_in` gives it fresh device blocks and schedules loads from those slots; as each load
is confirmed, `finish_swap_in` releases the slot and publishes the block if it is full and
committed. Private slots are never hit-able by another request and never evicted; ending the
request (free) releases them whatever the stage. The manager wraps these with its counters.
"""

from __future__ import annotations

from kvserve.kvcache.block import KVBlock
from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.ledger import RequestRecord
from kvserve.kvcache.publishing import announce, publish, withdraw
from kvserve.kvcache.stats import KVCacheCounters
from kvserve.kvcache.transfers import LoadSource, PendingLoad, TransferLedger


def start_swap_out(pool: BlockPool, transfers: TransferLedger | None,
                   pending: dict[bytes, str], record: RequestRecord,
                   counters: KVCacheCounters) -> bool:
    """Swap the request out. False, changing nothing but the fallback count, when it cannot
    be: no host tier, nothing computed, loads of its own in flight, or too few host slots free
    or evictable (a request with nothing computed loses nothing by recomputing: not counted)."""
    num_blocks = -(-record.num_computed_tokens // pool.block_size)
    slots = None
    if (transfers is not None and num_blocks and not record.swap_slots
            and not transfers.loads_of(record.request_id)
            and num_blocks <= len(record.block_table)):
        slots = transfers.swap_out(record.request_id, record.block_table[:num_blocks])
    if slots is None:
        counters.swap_fallbacks += num_blocks > 0
        return False
    counters.swapped_out_requests += 1
    record.swap_slots = slots
    withdraw(pending, record, list(record.pending_hashes))
    pool.free(reversed(record.block_table))  # deepest first, as every free
    record.block_table.clear()
    record.block_epochs.clear()
    return True


def start_swap_in(pool: BlockPool, transfers: TransferLedger, pending: dict[bytes, str],
                  record: RequestRecord, num_new_tokens: int, enable_prefix_caching: bool,
                  counters: KVCacheCounters) -> list[KVBlock] | None:
    """Fresh device blocks for the swapped-out request's computed tokens plus `num_new_tokens`,
    with loads from its slots scheduled. None, changing nothing, when too few blocks are free."""
    assert record.swap_slots and not record.block_table, "swap_in of a request not swapped out"
    bs = pool.block_size
    num_tokens = record.num_computed_tokens + num_new_tokens
    if num_new_tokens < 0 or num_tokens > len(record.token_ids):
        raise ValueError(f"request {record.request_id!r}: cannot resume with {num_new_tokens} "
                         f"new tokens after {record.num_computed_tokens} computed; it has "
                         f"only {len(record.token_ids)} tokens")
    blocks = pool.allocate(-(-num_tokens // bs), record.request_id)
    if blocks is None:
        return None
    for block in blocks:
        record.block_table.append(block)
        record.block_epochs.append(block.epoch)
    for idx, (slot_id, _) in enumerate(record.swap_slots):
        transfers.load(record.request_id, idx, blocks[idx], transfers.host.slots[slot_id],
                       LoadSource.SWAP)
    if enable_prefix_caching:
        announce(pending, pool, record, record.num_computed_tokens // bs)
    counters.swapped_in_requests += 1
    return blocks


def finish_swap_in(pool: BlockPool, transfers: TransferLedger, record: RequestRecord,
                   load: PendingLoad, enable_prefix_caching: bool) -> None:
    """A swap-in load was confirmed: its private slot goes free, and its block, if full and
    committed, becomes hit-able (the KV is written now, so invariant 4 holds)."""
    entry = next(s for s in record.swap_slots if s[0] == load.host_slot)
    record.swap_slots.remove(entry)
    transfers.release_swap([entry])
    num_full = record.num_computed_tokens // pool.block_size
    if enable_prefix_caching and load.block_idx < num_full:
        record.extend_hashes(num_full, pool.block_size)
        publish(pool, record, load.block_idx)
