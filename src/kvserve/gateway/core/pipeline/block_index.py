"""A bounded LRU set of prefix block hashes: what one worker is believed to cache."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class BlockIndex:
    """At most `capacity` block hashes, least recently touched evicted first. A chain is touched
    deepest block first, so its root is the most recent and a chain is evicted from its tail:
    what survives of a prefix is always a contiguous head, as in the worker's own cache.
    Lookups never change the recency order."""

    __slots__ = ("_blocks", "capacity")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"an index needs a capacity >= 1 block, got {capacity}")
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def num_matched(self, prefix_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of the chain the index holds (read-only)."""
        blocks = self._blocks
        for idx, block_hash in enumerate(prefix_hashes):
            if block_hash not in blocks:
                return idx
        return len(prefix_hashes)

    def touch_chain(self, prefix_hashes: Sequence[bytes]) -> None:
        """Insert or refresh a chain's blocks, evicting the least recent beyond capacity."""
        # Invariant: len(self) <= capacity after every single insertion.
        blocks = self._blocks
        # Blocks past the capacity would be evicted by this very chain's head: skip them.
        for block_hash in reversed(prefix_hashes[: self.capacity]):
            if block_hash in blocks:
                blocks.move_to_end(block_hash)
            else:
                blocks[block_hash] = None
                if len(blocks) > self.capacity:
                    blocks.popitem(last=False)

    def resize(self, capacity: int) -> None:
        """Hold at most `capacity` blocks from now on, evicting the least recent beyond it."""
        if capacity < 1:
            raise ValueError(f"an index needs a capacity >= 1 block, got {capacity}")
        self.capacity = capacity
        blocks = self._blocks
        while len(blocks) > capacity:
            blocks.popitem(last=False)

    def remove(self, block_hashes: Iterable[bytes]) -> None:
        """Forget these blocks (absent ones are ignored)."""
        for block_hash in block_hashes:
            self._blocks.pop(block_hash, None)

    def clear(self) -> None:
        """Forget every block."""
        self._blocks.clear()
