"""Exact states of the disk tier under the host tier: what the host LRU evicts is demoted to a
disk slot (readable only once confirmed), a prefix missing on device and host loads back from
the disk (and from both tiers block by block), a failed step undoes its demotions, and reset
clears every tier."""

from __future__ import annotations

import pytest

from kvserve.kvcache import CacheCorruption, FreeReason, KVCacheManager, KVTransfers, ViolationKind
from kvserve.kvcache.host_tier import SlotState
from kvserve.kvcache.transfers import BlockOffload, DiskLoad, SlotDemotion
from tests.kvcache.test_host_tier import BS, A, B, assert_clean, run

C = list(range(200, 213))  # 3 full blocks + 1 token: shares nothing with A or B
FREE, STORING, READY = SlotState.FREE, SlotState.STORING, SlotState.READY


def states(pool) -> list[tuple[SlotState, int]]:
    return [(s.state, s.epoch) for s in pool.slots]


def a_demoted_to_disk() -> tuple[KVCacheManager, KVTransfers]:
    """A ran, then B (evicting A's two blocks into the 2-slot host tier), then C's admission
    evicts B's cached blocks into the host, which demotes A's slots to the disk. C's copies
    are scheduled, not yet run."""
    m = KVCacheManager(4, BS, num_host_slots=2, num_disk_slots=4)
    run(m, "a", A)
    m.free("a")
    run(m, "b", B)
    m.free("b")
    assert m.pool.free_queue.block_ids() == [0, 1, 3, 2]  # b's partial head, then deepest first
    m.add_request("c", C)
    assert m.allocate_slots("c", len(C)) is not None
    return m, m.take_transfers()


def a2_loading_from_disk() -> KVCacheManager:
    """After `a_demoted_to_disk` ran and C left, A again: its two blocks are disk hits, their
    loads scheduled into fresh device blocks, not yet run."""
    m, transfers = a_demoted_to_disk()
    m.complete_transfers(transfers)
    m.commit("c", len(C))
    m.free("c")
    m.add_request("a2", A)
    allocation = m.allocate_slots("a2", 1, m.lookup("a2"))
    assert allocation is not None and allocation.num_cached_tokens == 8
    return m


def test_a_host_eviction_is_demoted_to_the_disk_and_readable_only_once_confirmed():
    m, transfers = a_demoted_to_disk()
    host, disk = m.transfers.host, m.transfers.disk
    # B's blocks 2 and 1 (device blocks 1, 3) take the host slots A's blocks 1 and 0 held,
    # which go to disk slots 0 and 1 first; B's root finds every host slot storing: dropped.
    assert transfers == KVTransfers(
        offloads=(BlockOffload(1, 0), BlockOffload(3, 1)),
        demotions=(SlotDemotion(0, 0), SlotDemotion(1, 1)),
    )
    assert states(host) == [(STORING, 2), (STORING, 2)]
    assert states(disk) == [(STORING, 1), (STORING, 1), (FREE, 0), (FREE, 0)]
    assert m.transfers.disk_stores == {0: 1, 1: 1}
    assert (host.counters.evictions, host.counters.dropped_stores) == (2, 1)
    m.add_request("a2", A)
    assert m.lookup("a2").num_tokens == 0, "a storing disk slot must not be readable"
    assert_clean(m, {"c", "a2"})

    m.complete_transfers(transfers)
    assert disk.lru_slot_ids() == [0, 1] and host.lru_slot_ids() == [0, 1]
    assert m.stats().disk.counters.stores == 2
    hit = m.lookup("a2")
    assert (hit.host_slots, hit.disk_slots, hit.disk_epochs) == ((), (1, 0), (1, 1))
    assert (hit.from_disk, hit.num_tokens) == ((True, True), 8)
    assert_clean(m, {"c", "a2"})


def test_a_disk_hit_loads_into_fresh_blocks_and_publishes_after_the_step():
    m = a2_loading_from_disk()
    table = m.block_table("a2")
    transfers = m.take_transfers()
    assert transfers.disk_loads == (DiskLoad(1, table[0]), DiskLoad(0, table[1]))
    disk = m.transfers.disk
    assert [s.pin_cnt for s in disk.slots] == [1, 1, 0, 0]
    assert not {table[0], table[1]} & {b.block_id for b in m.pool.cached.values()}
    assert_clean(m, {"a2"})
    m.complete_transfers(transfers)
    m.commit("a2", len(A))
    assert [s.pin_cnt for s in disk.slots] == [0] * 4
    counters = m.stats().disk.counters
    assert (counters.hit_blocks, counters.hit_tokens, counters.loads) == (2, 8, 2)
    m.add_request("a3", A)
    assert m.lookup("a3").block_ids == tuple(table[:2])  # published on the device now
    m.free("a2")
    m.free("a3")
    assert m.check_idle().ok


def test_a_chain_split_across_host_and_disk_is_one_hit():
    """The host tier gives up a chain's deepest block first (it was stored first), so a
    prefix often continues on the disk where the host stops: the hit takes both."""
    m = KVCacheManager(4, BS, num_host_slots=2, num_disk_slots=4)
    run(m, "a", A)
    m.free("a")
    run(m, "b", B)  # A's blocks 1 and 0 go to host slots 0 and 1
    m.free("b")
    host, disk = m.transfers.host, m.transfers.disk
    a_root, a_tail = host.slots[1].block_hash, host.slots[0].block_hash
    run(m, "d", list(range(300, 305)))  # evicts one of B's blocks: host slot 0 (A's tail) goes
    m.free("d")
    assert host.slots[1].block_hash == a_root and disk.slots[0].block_hash == a_tail
    m.add_request("a2", A)
    hit = m.lookup("a2")
    assert (hit.host_slots, hit.disk_slots, hit.from_disk) == ((1,), (0,), (False, True))
    assert hit.num_tokens == 8
    assert m.allocate_slots("a2", 1, hit) is not None
    transfers = m.take_transfers()
    table = m.block_table("a2")
    assert [(op.host_slot, op.block_id) for op in transfers.loads] == [(1, table[0])]
    assert transfers.disk_loads == (DiskLoad(0, table[1]),)
    assert_clean(m, {"a2"})
    m.complete_transfers(transfers)
    m.commit("a2", len(A))
    assert (host.counters.loads, disk.counters.loads) == (1, 1)
    m.free("a2")
    assert m.check_idle().ok


def test_verify_refuses_a_load_from_a_reassigned_disk_slot():
    m = a2_loading_from_disk()
    m.transfers.disk.slots[0].epoch += 1  # as if the slot was handed on under the load
    with pytest.raises(CacheCorruption, match="disk slot 0"):
        m.verify("a2")
    assert ViolationKind.HOST_LOAD_MISMATCH in m.audit().kinds()


def test_a_failed_step_undoes_its_demotions():
    m, transfers = a_demoted_to_disk()
    assert m.cancel_transfers(transfers) == set()
    disk = m.transfers.disk
    assert states(disk)[:2] == [(FREE, 1), (FREE, 1)] and not m.transfers.disk_stores
    assert m.stats().disk.counters.cancelled_stores == 2
    m.free("c", FreeReason.ERROR)
    m.add_request("a2", A)
    assert m.lookup("a2").num_tokens == 0  # what the failed step would have kept is gone
    m.free("a2")
    assert m.check_idle().ok


def test_reset_clears_every_tier_but_not_while_copies_are_in_flight():
    m, transfers = a_demoted_to_disk()
    m.free("c")
    assert not m.reset_prefix_cache()  # demotions and offloads unconfirmed
    m.complete_transfers(transfers)
    assert m.reset_prefix_cache()
    assert not m.transfers.disk.lru and len(m.transfers.disk.free_ids) == 4
    assert m.check_idle().ok


def test_a_disk_tier_needs_a_host_tier():
    with pytest.raises(ValueError, match="needs a host tier"):
        KVCacheManager(4, BS, num_disk_slots=4)
