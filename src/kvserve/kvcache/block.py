"""One KV block's bookkeeping: identity, refcount, content key, epoch, free-queue links."""

from __future__ import annotations


class KVBlock:
    """Metadata of one physical block of `block_size` token slots.

    A block is in exactly one state: held (`ref_cnt > 0`), or free (`ref_cnt == 0`, linked into the
    free queue). A free block with a `block_hash` is *cached*: still hit-able until evicted.
    `epoch` changes every time the block is handed to new content, so a block table that remembers
    the epoch it saw can tell if its block was reassigned underneath it.
    """

    __slots__ = (
        "adapter_digest",
        "block_hash",
        "block_id",
        "cached_epoch",
        "checksum",
        "epoch",
        "last_owner",
        "next_free",
        "parent_hash",
        "prev_free",
        "ref_cnt",
        "salt",
        "token_bytes",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.epoch = 0
        # Content key, set only once the KV of a full block is written (see BlockPool.cache_block).
        self.block_hash: bytes | None = None
        self.parent_hash: bytes | None = None
        self.token_bytes: bytes | None = None  # the tokens the hash covers, for the hit re-check
        self.salt: str | None = None  # tenant whose request computed this content
        self.adapter_digest: bytes | None = None  # LoRA adapter it was computed under
        self.cached_epoch = -1  # the epoch at which the content key was set
        self.last_owner: str | None = None  # the request that most recently took a reference
        self.checksum: int | None = None  # optional content checksum fed by the model layer
        # Intrusive links of the free queue; both None while the block is held.
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    @property
    def is_cached(self) -> bool:
        return self.block_hash is not None

    def clear_content(self) -> None:
        """Forget the content key; the caller bumps the epoch when it hands the block on."""
        self.block_hash = None
        self.parent_hash = None
        self.token_bytes = None
        self.salt = None
        self.adapter_digest = None
        self.checksum = None
        self.cached_epoch = -1

    def __repr__(self) -> str:
        cached = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, epoch={self.epoch}, hash={cached})"
