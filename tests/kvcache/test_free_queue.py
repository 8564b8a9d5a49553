"""The intrusive free queue: O(1) moves, exact order, no double links."""

import pytest

from kvserve.kvcache.block import KVBlock
from kvserve.kvcache.free_queue import FreeBlockQueue


def make_queue(n: int) -> tuple[FreeBlockQueue, list[KVBlock]]:
    blocks = [KVBlock(i) for i in range(n)]
    return FreeBlockQueue(blocks), blocks


def test_initial_order_is_block_id_order():
    queue, _ = make_queue(5)
    assert queue.block_ids() == [0, 1, 2, 3, 4]
    assert queue.num_free_blocks == 5


def test_popleft_remove_append_appendleft_exact_order():
    queue, blocks = make_queue(5)
    assert queue.popleft() is blocks[0]
    queue.remove(blocks[2])
    assert queue.block_ids() == [1, 3, 4]
    queue.append(blocks[2])
    queue.appendleft(blocks[0])
    assert queue.block_ids() == [0, 1, 3, 4, 2]
    assert queue.num_free_blocks == 5


def test_removed_block_has_no_links_and_cannot_be_removed_twice():
    queue, blocks = make_queue(3)
    queue.remove(blocks[1])
    assert blocks[1].prev_free is None and blocks[1].next_free is None
    with pytest.raises(AssertionError, match="not in the free queue"):
        queue.remove(blocks[1])


def test_a_queued_block_cannot_be_queued_again():
    queue, blocks = make_queue(3)
    with pytest.raises(AssertionError, match="already queued"):
        queue.append(blocks[0])


def test_popleft_on_empty_queue_is_a_bug():
    queue, _ = make_queue(1)
    queue.popleft()
    assert queue.block_ids() == []
    with pytest.raises(AssertionError, match="empty"):
        queue.popleft()


def test_iteration_stops_on_a_corrupted_cycle():
    queue, blocks = make_queue(3)
    blocks[2].next_free = blocks[0]  # a cycle that skips the tail sentinel
    assert len(list(queue)) == queue.num_free_blocks + 1


def test_popleft_n_splices_the_head():
    queue, blocks = make_queue(5)
    taken = queue.popleft_n(3)
    assert [b.block_id for b in taken] == [0, 1, 2]
    assert all(b.prev_free is None and b.next_free is None for b in taken)
    assert queue.block_ids() == [3, 4] and queue.num_free_blocks == 2
    assert queue.popleft_n(0) == []
    queue.append(blocks[0])
    assert queue.block_ids() == [3, 4, 0]
    with pytest.raises(AssertionError):
        queue.popleft_n(4)
