"""From written KV to shareable blocks: announcements while a block is computed, then publishing.

A request announces the full prompt blocks it was given room for and will now compute (or load
from the host tier) in `pending` (block hash -> request id), so another request that needs the
same blocks waits and hits them instead of computing them twice. Once the KV is written, a block
is published into the pool's hash map (invariant 4: never earlier) and its announcement is
withdrawn; if another request published the same content first, the request adopts that cached
twin, so a prefix stays one chain and deepest-first release keeps it a contiguous head.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.ledger import RequestRecord


def announce(pending: dict[bytes, str], pool: BlockPool, record: RequestRecord,
             first: int) -> None:
    """Announce the request's full blocks from `first` to the end of its table, unless cached
    or already announced (by it or by someone else, who keeps the announcement)."""
    bs = pool.block_size
    last = min(len(record.block_table), len(record.token_ids) // bs)
    record.extend_hashes(last, bs)
    owned = set(record.pending_hashes)
    for idx in range(first, last):
        block_hash = record.block_hashes[idx]
        if block_hash in owned or block_hash in pool.cached:
            continue
        if pending.setdefault(block_hash, record.request_id) == record.request_id:
            record.pending_hashes.append(block_hash)


def withdraw(pending: dict[bytes, str], record: RequestRecord, hashes: Sequence[bytes]) -> None:
    """Drop the request's announcements of `hashes` (published, or the request is gone)."""
    if not hashes:
        return
    gone = set(hashes)
    for block_hash in gone:
        if pending.get(block_hash) == record.request_id:
            del pending[block_hash]
    record.pending_hashes = [h for h in record.pending_hashes if h not in gone]


def publish(pool: BlockPool, record: RequestRecord, idx: int) -> None:
    """Make the request's fully written block `idx` hit-able, or switch to its cached twin."""
    bs = pool.block_size
    parent = record.block_hashes[idx - 1] if idx else None
    token_ids = record.token_ids[idx * bs : (idx + 1) * bs]
    if pool.cache_block(record.block_table[idx], record.block_hashes[idx], parent, token_ids,
                        record.block_token_bytes[idx], record.salt, record.adapter_digest):
        return
    # Two requests computed the same content at once: keep the cached one, free the duplicate.
    twin = pool.cached[record.block_hashes[idx]]
    duplicate = record.block_table[idx]
    pool.touch([twin], record.request_id)
    record.block_table[idx] = twin
    record.block_epochs[idx] = twin.epoch
    pool.free([duplicate])
