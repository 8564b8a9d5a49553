"""An O(1) intrusive doubly-linked free queue of KV blocks, in eviction order.

The head is taken first. Freed cached blocks go to the tail (least recently released is evicted
first); freed uncached blocks go to the head (they hold nothing worth keeping).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvserve.kvcache.block import KVBlock


class FreeBlockQueue:
    """Free blocks linked through `KVBlock.prev_free/next_free`, with sentinels at both ends.

    Every operation is O(1) except construction and iteration. A block is in the queue exactly
    when its links are set; the queue never holds a block twice.
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        """Take the block at the head (the next to be reused). The queue must not be empty."""
        block = self._head.next_free
        assert block is not None and block is not self._tail, "popleft from an empty free queue"
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVBlock]:
        """Take the `n` blocks at the head in one splice. There must be at least `n`."""
        assert 0 <= n <= self.num_free_blocks, f"popleft_n({n}) with {self.num_free_blocks} free"
        out: list[KVBlock] = []
        node = self._head.next_free
        for _ in range(n):
            assert node is not None
            out.append(node)
            nxt = node.next_free
            node.prev_free = node.next_free = None
            node = nxt
        assert node is not None
        self._head.next_free = node
        node.prev_free = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVBlock) -> None:
        """Unlink `block`, which must be in the queue."""
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVBlock) -> None:
        """Link `block` at the tail (evicted last)."""
        self._insert_before(self._tail, block)

    def appendleft(self, block: KVBlock) -> None:
        """Link `block` at the head (reused first)."""
        nxt = self._head.next_free
        assert nxt is not None
        self._insert_before(nxt, block)

    def _insert_before(self, anchor: KVBlock, block: KVBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"{block} is already queued"
        prev = anchor.prev_free
        assert prev is not None
        prev.next_free = block
        block.prev_free = prev
        block.next_free = anchor
        anchor.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVBlock]:
        """Blocks from head to tail. Stops after `num_free_blocks + 1` steps so a corrupted
        (cyclic) list cannot loop forever; the audit compares the count it saw."""
        node = self._head.next_free
        for _ in range(self.num_free_blocks + 1):
            if node is None or node is self._tail:
                return
            yield node
            node = node.next_free

    def block_ids(self) -> list[int]:
        """Block ids in eviction order (head first); for tests and debugging."""
        return [block.block_id for block in self]

    @property
    def head_sentinel(self) -> KVBlock:
        return self._head

    @property
    def tail_sentinel(self) -> KVBlock:
        return self._tail
