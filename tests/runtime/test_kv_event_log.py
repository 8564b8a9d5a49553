"""The worker's KV event log: numbered, bounded, and honest about what a reader missed."""

from __future__ import annotations

import pytest

from kvserve.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvserve.runtime.kv_event_log import KVEventLog

H = [bytes([i]) * 32 for i in range(8)]


def stored(*hashes: bytes, parent: bytes | None = None) -> BlockStored:
    return BlockStored(tuple(hashes), parent, (), 16)


def test_events_are_numbered_from_one_and_read_after_a_cursor() -> None:
    log = KVEventLog()
    log.extend([stored(H[0], H[1]), BlockRemoved((H[0],)), AllBlocksCleared()])
    page = log.since(0)
    assert [e["seq"] for e in page.events] == [1, 2, 3] and page.next_seq == 3 and not page.gap
    assert page.events[0] == {"seq": 1, "type": "stored", "parent_block_hash": None,
                              "block_hashes": [H[0].hex(), H[1].hex()]}
    assert page.events[1] == {"seq": 2, "type": "removed", "block_hashes": [H[0].hex()]}
    assert page.events[2] == {"seq": 3, "type": "cleared"}
    assert log.since(3).events == [] and log.since(3).next_seq == 3
    log.extend([stored(H[2], parent=H[1])])
    later = log.since(3)
    assert [e["seq"] for e in later.events] == [4]
    assert later.events[0]["parent_block_hash"] == H[1].hex()


def test_a_page_is_limited_and_the_cursor_continues() -> None:
    log = KVEventLog()
    log.extend(stored(h) for h in H)
    first = log.since(0, limit=3)
    assert [e["seq"] for e in first.events] == [1, 2, 3] and first.next_seq == 3
    rest = log.since(first.next_seq, limit=100)
    assert [e["seq"] for e in rest.events] == [4, 5, 6, 7, 8] and not rest.gap


def test_a_reader_that_fell_behind_the_bound_is_told_of_the_gap() -> None:
    log = KVEventLog(capacity=3)
    log.extend(stored(h) for h in H)  # only 6, 7, 8 are kept
    page = log.since(2)
    assert page.gap and [e["seq"] for e in page.events] == [6, 7, 8]
    assert not log.since(5).gap  # 5 read: nothing missing
    restarted = log.since(100)  # a cursor from an earlier process of this worker
    assert restarted.gap and restarted.events == [] and restarted.next_seq == 8


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        KVEventLog(capacity=0)
    with pytest.raises(ValueError, match="limit"):
        KVEventLog().since(0, limit=0)
