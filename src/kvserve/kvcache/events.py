"""KV events, shaped like vLLM's, so a router can keep an exact index of a worker's cache.

A `BlockStored` is published only after the block's KV was written (the block became shareable);
a `BlockRemoved` when a cached block is evicted or cleared; `AllBlocksCleared` when the whole
prefix cache is reset.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that became hit-able. `block_hashes` extend the chain starting after
    `parent_block_hash` (None for a chain that starts at the root)."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    cache_salt: str | None = None
    adapter_digest: bytes | None = None  # the LoRA adapter's sha256 (None: the base model)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks that are no longer hit-able (evicted or cleared)."""

    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The prefix cache was reset: forget every block of this worker."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
