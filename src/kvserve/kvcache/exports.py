"""A prompt's full blocks by chained hash, for sending their KV to another worker.

Read-only over the pool: finds the cached blocks that hold a prompt's full blocks right after
the step that computed them (published, so their KV is written), before anything else can
reuse them.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.hashing import encode_extra_keys
from kvserve.kvcache.ledger import RequestRecord


def prompt_record(request_id: str, token_ids: Sequence[int], cache_salt: str | None,
                  model_id: str, block_size: int, num_blocks: int,
                  adapter_digest: bytes | None = None) -> RequestRecord:
    """A record (not in any ledger) with the chained hashes of the prompt's first
    `num_blocks` full blocks, exactly as the manager hashes a request's blocks (the adapter's
    digest included: a transfer key never leaves the adapter out)."""
    record = RequestRecord(request_id, list(token_ids), cache_salt,
                           encode_extra_keys(model_id, adapter_digest, cache_salt), 0.0, 0.0,
                           adapter_digest)
    record.extend_hashes(num_blocks, block_size)
    return record


def cached_block_ids(pool: BlockPool, record: RequestRecord, first: int,
                     stop: int) -> list[int] | None:
    """Ids of the cached blocks holding the record's blocks `[first, stop)` (hash and tokens
    re-checked), or None if any of them is not cached. Changes nothing but hit-check counters."""
    out = []
    for idx in range(first, stop):
        block = pool.get_cached_block(record.block_hashes[idx], record.block_token_bytes[idx])
        if block is None:
            return None
        out.append(block.block_id)
    return out
