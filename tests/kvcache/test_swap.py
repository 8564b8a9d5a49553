"""Exact states of preemption by swapping: the victim's blocks, partial last block included, go
to host slots private to it (unreadable until confirmed, never hit-able), its device blocks are
freed, and swap_in copies them back into fresh blocks; refusals change nothing; ending a
swapped-out request releases its slots."""

from __future__ import annotations

from kvserve.kvcache import FreeReason, KVCacheManager, KVTransfers
from kvserve.kvcache.host_tier import SlotState
from kvserve.kvcache.transfers import BlockLoad, BlockOffload
from tests.kvcache.conftest import state_of
from tests.kvcache.test_host_tier import BS, A, assert_clean, host_state, step

SWAPPING, SWAPPED, FREE = SlotState.SWAPPING, SlotState.SWAPPED, SlotState.FREE


def decoded_a(num_host_slots: int = 4) -> KVCacheManager:
    """A's 9 prompt tokens and one decoded token are computed: 3 blocks, the last partial."""
    m = KVCacheManager(6, BS, num_host_slots=num_host_slots)
    m.add_request("a", A)
    assert m.allocate_slots("a", len(A)) is not None
    m.commit("a", len(A))
    m.append_token_ids("a", [50])
    assert m.allocate_slots("a", 1) is not None
    m.commit("a", len(A) + 1)
    assert m.block_table("a") == [0, 1, 2]
    return m


def test_swap_out_copies_every_computed_block_and_frees_the_device():
    m = decoded_a()
    assert m.swap_out("a") and m.is_swapped("a")
    host = m.transfers.host
    assert [(s.state, s.owner) for s in host.slots] == [(SWAPPING, "a")] * 3 + [(FREE, None)]
    assert m.ledger.get("a").swap_slots == [(0, 1), (1, 1), (2, 1)]
    assert m.block_table("a") == [] and m.num_computed_tokens("a") == 10
    assert m.stats().num_held_blocks == 0
    assert len(m.pool.cached) == 2  # the two full blocks stay hit-able on the device
    transfers = m.take_transfers()
    assert transfers == KVTransfers(offloads=(BlockOffload(0, 0), BlockOffload(1, 1),
                                              BlockOffload(2, 2)))
    assert_clean(m, {"a"})
    m.complete_transfers(transfers)
    assert [s.state for s in host.slots[:3]] == [SWAPPED] * 3
    assert not host.lru, "a swap slot is never hit-able"
    counters = m.stats().counters
    assert (counters.swapped_out_requests, host.counters.swapped_out_blocks) == (1, 3)
    assert_clean(m, {"a"})


def test_swap_in_copies_back_into_fresh_blocks_and_frees_the_slots_once_confirmed():
    m = decoded_a()
    m.swap_out("a")
    step(m)
    m.add_request("b", list(range(100, 121)))  # 21 tokens: evicts a's cached blocks
    assert m.allocate_slots("b", 21) is not None
    step(m)
    m.commit("b", 21)
    m.free("b")
    m.append_token_ids("a", [51])  # the token sampled before it was preempted
    allocation = m.swap_in("a", 1)
    assert allocation is not None and not m.is_swapped("a")
    table = m.block_table("a")
    assert len(table) == 3 and m.num_computed_tokens("a") == 10
    transfers = m.take_transfers()
    assert transfers.loads == (BlockLoad(0, table[0]), BlockLoad(1, table[1]),
                               BlockLoad(2, table[2]))
    assert not set(table) & {b.block_id for b in m.pool.cached.values()}, "published early"
    assert_clean(m, {"a"})
    m.complete_transfers(transfers)
    host = m.transfers.host
    assert all(s.state is not SWAPPED for s in host.slots) and not m.ledger.get("a").swap_slots
    assert {table[0], table[1]} <= {b.block_id for b in m.pool.cached.values()}
    assert host.counters.swapped_in_blocks == 3 and m.stats().counters.swapped_in_requests == 1
    m.commit("a", 11)
    assert_clean(m, {"a"})
    m.free("a")
    assert m.check_idle().ok


def test_a_swap_the_host_cannot_hold_is_refused_and_changes_nothing():
    m = decoded_a(num_host_slots=2)
    before, host_before = state_of(m), host_state(m)
    assert not m.swap_out("a")
    after = state_of(m)
    assert after[:4] + after[5:] == before[:4] + before[5:] and host_state(m) == host_before
    assert after[4].counters.swap_fallbacks == 1 and not m.is_swapped("a")  # only counted


def test_a_swap_in_without_room_is_refused_and_changes_nothing():
    m = decoded_a()
    m.swap_out("a")
    step(m)
    m.add_request("b", list(range(100, 113)))
    assert m.allocate_slots("b", 13) is not None  # 4 of the 6 blocks held: 3 are needed
    step(m)
    m.append_token_ids("a", [51])
    before, host_before = state_of(m), host_state(m)
    assert m.swap_in("a", 1) is None
    assert state_of(m) == before and host_state(m) == host_before


def test_ending_a_swapped_out_request_releases_its_slots_even_mid_copy():
    m = decoded_a()
    m.swap_out("a")
    transfers = m.take_transfers()  # the model is copying out while the request is aborted
    assert m.free("a", FreeReason.ABORTED) == 0
    host = m.transfers.host
    assert [s.state for s in host.slots] == [FREE] * 4 and not m.transfers.swap_stores
    m.complete_transfers(transfers)  # the copies land in free slots and confirm nothing
    assert [s.state for s in host.slots] == [FREE] * 4
    assert m.check_idle().ok
