"""Exact states of the host tier under the device pool: offload on eviction, load on a host hit,
LRU order, salts, the token re-check, all-or-nothing, and cancellation before confirmation."""

from __future__ import annotations

import pytest

from kvserve.kvcache import (
    BlockLoad,
    BlockOffload,
    CacheCorruption,
    FreeReason,
    KVCacheManager,
    KVTransfers,
    ViolationKind,
)
from kvserve.kvcache.host_tier import HostTier, SlotState
from tests.kvcache.conftest import state_of

BS = 4
A = list(range(0, 9))  # 2 full blocks + 1 token
B = list(range(100, 113))  # 3 full blocks + 1 token: shares nothing with A


def step(m: KVCacheManager) -> KVTransfers:
    """What the engine does after scheduling: the model runs the copies, then they confirm."""
    transfers = m.take_transfers()
    m.complete_transfers(transfers)
    return transfers


def run(m: KVCacheManager, rid: str, tokens: list[int], salt: str | None = None):
    """Admit a whole prompt in one step: lookup, allocate, copies, commit. Returns the hit and
    the step's transfers."""
    m.add_request(rid, tokens, cache_salt=salt)
    hit = m.lookup(rid)
    assert m.allocate_slots(rid, len(tokens) - hit.num_tokens, hit) is not None
    transfers = step(m)
    m.commit(rid, len(tokens))
    return hit, transfers


def host_state(m: KVCacheManager) -> tuple:
    host = m.transfers.host
    return (
        [(s.state, s.epoch, s.pin_cnt, s.block_hash) for s in host.slots],
        host.lru_slot_ids(),
        list(host.free_ids),
        dict(m.transfers.stores),
        dict(m.transfers.loads),
    )


def assert_clean(m: KVCacheManager, live: set[str]) -> None:
    report = m.audit(live_request_ids=live)
    assert report.ok, report.describe()


def evicted_a(num_host_slots: int = 4) -> KVCacheManager:
    """A ran and finished; B's admission evicted both of A's cached blocks into the host."""
    m = KVCacheManager(4, BS, num_host_slots=num_host_slots)
    run(m, "a", A)
    m.free("a")
    assert m.pool.free_queue.block_ids() == [2, 3, 1, 0]  # partial head, deepest cached first
    m.add_request("b", B)
    assert m.allocate_slots("b", len(B)) is not None
    return m


def a2_loading_from_host() -> KVCacheManager:
    """`evicted_a`, B's step confirmed and B gone; a2 (A again) admitted: its two blocks come
    from the host tier, with loads scheduled and not yet taken."""
    m = evicted_a()
    step(m)
    m.commit("b", len(B))
    m.free("b")
    m.add_request("a2", A)
    assert m.allocate_slots("a2", 1, m.lookup("a2")) is not None
    return m


def test_evicted_cached_blocks_land_in_the_host_tier_only_once_confirmed():
    m = evicted_a()
    transfers = m.take_transfers()
    # Deepest first, as the device evicts them: A's block 1 into slot 0, A's root into slot 1.
    assert transfers == KVTransfers(offloads=(BlockOffload(1, 0), BlockOffload(0, 1)))
    host = m.transfers.host
    assert [s.state for s in host.slots] == [SlotState.STORING] * 2 + [SlotState.FREE] * 2
    m.add_request("a2", A)
    assert m.lookup("a2").num_tokens == 0, "a storing slot must not be readable"
    assert_clean(m, {"b", "a2"})

    m.complete_transfers(transfers)
    assert host.lru_slot_ids() == [0, 1]
    assert m.stats().host.counters.stores == 2
    hit = m.lookup("a2")
    assert (hit.block_ids, hit.host_slots, hit.num_tokens) == ((), (1, 0), 8)
    assert hit.host_epochs == (1, 1)
    assert_clean(m, {"b", "a2"})


def test_a_host_hit_loads_into_fresh_blocks_and_publishes_after_the_step():
    m = evicted_a()
    step(m)
    m.commit("b", len(B))
    m.free("b")
    assert m.pool.free_queue.block_ids() == [0, 1, 3, 2]
    m.add_request("a2", A)
    hit = m.lookup("a2")
    allocation = m.allocate_slots("a2", 1, hit)
    assert allocation is not None and allocation.num_cached_tokens == 8
    assert m.block_table("a2") == [0, 1, 3]
    assert m.num_computed_tokens("a2") == 8  # the loaded blocks count as computed
    transfers = m.take_transfers()
    # B's blocks 1 and 3 are evicted (offloaded) and reused for A's loads: offloads run first.
    assert transfers == KVTransfers(
        offloads=(BlockOffload(1, 2), BlockOffload(3, 3)),
        loads=(BlockLoad(1, 0), BlockLoad(0, 1)),
    )
    assert [s.pin_cnt for s in m.transfers.host.slots] == [1, 1, 0, 0]
    # A twin arriving before the copy is confirmed waits for it rather than loading it twice.
    m.add_request("a3", A)
    twin_hit = m.lookup("a3")
    assert (twin_hit.num_tokens, twin_hit.num_pending_tokens) == (0, 8)
    assert not {0, 1} & {b.block_id for b in m.pool.cached.values()}, "published too early"
    assert_clean(m, {"a2", "a3"})

    m.complete_transfers(transfers)
    m.commit("a2", len(A))
    assert [s.pin_cnt for s in m.transfers.host.slots] == [0, 0, 0, 0]
    assert m.lookup("a3").block_ids == (0, 1)  # published on the device now
    counters = m.stats().host.counters
    assert (counters.hit_blocks, counters.hit_tokens, counters.loads) == (2, 8, 2)
    assert m.stats().counters.prefix_hits_tokens == 8
    assert_clean(m, {"a2", "a3"})
    m.free("a2")
    m.free("a3")
    assert m.check_idle().ok


def test_host_lru_evicts_the_least_recent_unpinned_slot_and_drops_when_all_are_pinned():
    host = HostTier(2)
    keys = [bytes([i]) * 32 for i in range(4)]
    for key in keys[:2]:
        slot = host.reserve(key, None, key, None)
        host.confirm_store(slot.slot_id, slot.epoch)
    assert host.lru_slot_ids() == [0, 1]
    host.pin(host.get(keys[0], keys[0]))  # a load reads slot 0: most recent, and kept
    assert host.lru_slot_ids() == [1, 0]
    third = host.reserve(keys[2], None, keys[2], None)
    assert third.slot_id == 1 and third.epoch == 2 and host.get(keys[1], keys[1]) is None
    assert host.reserve(keys[3], None, keys[3], None) is None  # slot 0 pinned, slot 1 storing
    assert (host.counters.evictions, host.counters.dropped_stores) == (1, 1)
    host.unpin(0)
    host.confirm_store(third.slot_id, third.epoch)
    assert host.lru_slot_ids() == [0, 1]


def test_tenants_never_share_through_the_host_tier():
    m = KVCacheManager(4, BS, num_host_slots=4)
    run(m, "a", A, salt="tenant-a")
    m.free("a")
    run(m, "b", B)  # evicts tenant a's blocks into the host
    m.free("b")
    assert len(m.transfers.host.lru) == 2
    m.add_request("other", A, cache_salt="tenant-b")
    m.add_request("unsalted", A)
    m.add_request("same", A, cache_salt="tenant-a")
    assert m.lookup("other").num_tokens == 0 and m.lookup("unsalted").num_tokens == 0
    assert m.lookup("same").host_slots == (1, 0)


def test_the_token_recheck_refuses_a_colliding_host_entry():
    m = evicted_a()
    step(m)
    host = m.transfers.host
    deep = host.slots[0]  # A's block 1: same hash, other tokens (what a collision looks like)
    deep.token_bytes = bytes(len(deep.token_bytes))
    m.add_request("a2", A)
    hit = m.lookup("a2")
    assert hit.host_slots == (1,) and hit.num_tokens == 4
    assert host.counters.hash_collisions == 1
    kinds = m.audit().kinds()
    assert kinds == {ViolationKind.HOST_HASH_MISMATCH}  # and the audit names the bad entry


def test_a_refused_allocation_changes_nothing_in_either_tier():
    m = evicted_a()
    step(m)
    m.commit("b", len(B))
    m.add_request("a2", A + [0] * 8)  # 17 tokens: 5 blocks, but b holds all 4 device blocks
    hit = m.lookup("a2")
    assert hit.host_slots == (1, 0)
    before, host_before = state_of(m), host_state(m)
    assert m.allocate_slots("a2", 9, hit) is None
    assert state_of(m) == before and host_state(m) == host_before
    assert not m.take_transfers()
    assert_clean(m, {"b", "a2"})


@pytest.mark.parametrize("taken", [False, True])
def test_a_request_ended_before_its_loads_confirm_leaves_nothing_readable(taken: bool):
    m = a2_loading_from_host()
    transfers = m.take_transfers() if taken else None
    m.free("a2", FreeReason.ABORTED)
    host = m.transfers.host
    assert [s.pin_cnt for s in host.slots] == [0, 0, 0, 0]
    assert m.stats().host.counters.cancelled_loads == 2
    if transfers is None:  # the copies never reach the model; the offloads still do
        transfers = m.take_transfers()
        assert not transfers.loads and len(transfers.offloads) == 2
    m.complete_transfers(transfers)  # the stale loads are skipped, never published
    assert m.stats().host.counters.loads == 0
    m.add_request("a3", A)
    hit = m.lookup("a3")
    assert hit.block_ids == () and hit.host_slots == (1, 0)  # the host copies are intact
    assert m.free("a3") == 0
    idle = m.check_idle()
    assert idle.ok, idle.describe()


def test_a_failed_step_cancels_its_copies_and_names_the_requests_to_end():
    m = a2_loading_from_host()
    transfers = m.take_transfers()
    assert m.cancel_transfers(transfers) == {"a2"}
    host = m.transfers.host
    assert [s.state for s in host.slots] == [SlotState.READY] * 2 + [SlotState.FREE] * 2
    assert [s.pin_cnt for s in host.slots] == [0] * 4
    assert m.stats().host.counters.cancelled_stores == 2
    assert not m.pool.cached.keys() & set(m.ledger.get("a2").block_hashes)
    m.free("a2", FreeReason.ERROR)
    assert m.check_idle().ok


def test_verify_refuses_a_load_from_a_reassigned_slot():
    m = a2_loading_from_host()
    m.transfers.host.slots[1].epoch += 1  # as if the slot was handed on under the load
    with pytest.raises(CacheCorruption, match="host slot 1"):
        m.verify("a2")
    assert ViolationKind.HOST_LOAD_MISMATCH in m.audit().kinds()


def test_a_stale_host_hit_is_refused_and_changes_nothing():
    m = evicted_a(num_host_slots=2)
    step(m)
    m.commit("b", len(B))
    m.free("b")
    m.add_request("a2", A)
    hit = m.lookup("a2")
    m.add_request("c", list(range(200, 213)))
    assert m.allocate_slots("c", 13) is not None  # evicts b's blocks: A's slots are reused
    step(m)
    before, host_before = state_of(m), host_state(m)
    with pytest.raises(ValueError, match="stale prefix hit"):
        m.allocate_slots("a2", 1, hit)
    assert state_of(m) == before and host_state(m) == host_before


def test_reset_clears_both_tiers_but_not_while_copies_are_in_flight():
    m = evicted_a()
    m.free("b")
    assert not m.reset_prefix_cache()  # offloads scheduled, not confirmed
    step(m)
    assert m.reset_prefix_cache()
    assert not m.transfers.host.lru and len(m.transfers.host.free_ids) == 4
    assert m.check_idle().ok
