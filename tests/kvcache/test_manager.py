"""Exact states of the request-level cache manager (DESIGN.md invariants 1-9)."""

from __future__ import annotations

import pytest

from kvserve.kvcache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheCorruption,
    FreeReason,
    KVCacheManager,
    UnknownRequest,
)
from tests.kvcache.conftest import admit, state_of

BS = 4


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_free_queue_order_after_frees_is_deepest_first_and_uncached_at_head():
    m = KVCacheManager(8, BS)
    admit(m, "a", tokens(0, 10))  # blocks 0,1 full and cached; block 2 partial (uncached)
    assert m.block_table("a") == [0, 1, 2]
    assert m.pool.free_queue.block_ids() == [3, 4, 5, 6, 7]
    m.free("a")
    # The partial block holds nothing reusable: head. Cached blocks: tail, deepest first.
    assert m.pool.free_queue.block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    assert m.audit().ok


def test_eviction_order_across_two_requests_is_lru_by_release_then_deepest_first():
    m = KVCacheManager(6, BS)
    admit(m, "a", tokens(0, 8) + [-1])  # blocks 0,1 cached, 2 partial
    admit(m, "b", tokens(100, 8) + [-1])  # blocks 3,4 cached, 5 partial
    m.free("a")
    m.free("b")
    assert m.pool.free_queue.block_ids() == [5, 2, 1, 0, 4, 3]
    m.add_request("c", tokens(200, 12))
    assert m.allocate_slots("c", 12) is not None
    # Two uncached blocks first, then a's deepest block: a's root block 0 survives.
    assert m.block_table("c") == [5, 2, 1]
    assert m.counters.evicted_blocks == 1
    m.add_request("a2", tokens(0, 8) + [-2])
    assert m.lookup("a2").num_tokens == 4  # a contiguous head survived
    m.free("a2")


def test_prefix_hit_shares_blocks_and_counts_tokens():
    m = KVCacheManager(10, BS)
    admit(m, "a", tokens(0, 10))
    hit, allocation = admit(m, "b", tokens(0, 8) + [50, 51, 52])
    assert hit.block_ids == (0, 1) and hit.num_tokens == 8
    assert m.block_table("b") == [0, 1, 3]
    assert allocation.new_block_ids == (3,) and allocation.num_cached_tokens == 8
    assert [m.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    counters = m.stats().counters
    assert counters.prefix_queries_tokens == 21 and counters.prefix_hits_tokens == 8
    assert m.audit(live_request_ids={"a", "b"}).ok


def test_lookup_is_read_only():
    m = KVCacheManager(10, BS)
    admit(m, "a", tokens(0, 9))
    m.free("a")
    m.add_request("b", tokens(0, 9))
    before = state_of(m)
    assert m.lookup("b").num_tokens == 8
    assert state_of(m) == before


def test_hit_cap_leaves_one_token_to_compute_on_block_aligned_prompts():
    m = KVCacheManager(10, BS)
    admit(m, "a", tokens(0, 8))
    m.free("a")
    m.add_request("b", tokens(0, 8))
    hit = m.lookup("b")
    assert hit.num_tokens == 4  # not 8: the last token's logits must be computed
    assert m.allocate_slots("b", 4, hit) is not None
    assert m.block_table("b") == [0, 2]  # block 1 stays cached, a fresh block recomputes it
    m.add_request("c", tokens(0, 1))
    assert m.lookup("c").num_tokens == 0


def test_allocation_failure_changes_nothing():
    m = KVCacheManager(5, BS)
    admit(m, "a", tokens(0, 8))  # cached blocks 0, 1
    m.free("a")
    admit(m, "b", tokens(100, 9))  # takes 3 blocks: 2, 3 (uncached) then 4
    m.add_request("c", tokens(0, 8) + tokens(500, 9))  # hit 0,1; needs 3 more; only 0 free
    hit = m.lookup("c")
    assert hit.num_tokens == 8
    before = state_of(m)
    assert m.allocate_slots("c", 9, hit) is None
    assert state_of(m) == before
    assert m.audit(live_request_ids={"b", "c"}).ok


def test_reused_block_loses_its_hash_and_gets_a_new_epoch():
    m = KVCacheManager(2, BS)
    admit(m, "a", tokens(0, 8))
    m.free("a")
    epoch = m.pool.blocks[1].epoch
    old_hash = m.pool.blocks[1].block_hash
    m.add_request("b", tokens(100, 4))
    assert m.allocate_slots("b", 4) is not None
    assert m.block_table("b") == [1]  # the deepest cached block is evicted first
    reused = m.pool.blocks[1]
    assert reused.block_hash is None and reused.token_bytes is None
    assert reused.epoch == epoch + 1
    assert old_hash not in m.pool.cached
    assert m.audit().ok


def test_no_block_is_handed_out_twice():
    m = KVCacheManager(16, BS)
    for i in range(4):
        admit(m, f"r{i}", tokens(0, 8) + tokens(100 * (i + 1), 6))
    tables = [m.block_table(f"r{i}") for i in range(4)]
    private = [b for t in tables for b in t[2:]]
    assert len(private) == len(set(private)) == 8
    assert all(t[:2] == [0, 1] for t in tables)


def test_salted_tenants_never_share_and_same_salt_does():
    m = KVCacheManager(16, BS)
    admit(m, "a", tokens(0, 9), salt="tenant-a")
    hit_b, _ = admit(m, "b", tokens(0, 9), salt="tenant-b")
    hit_a2, _ = admit(m, "a2", tokens(0, 9), salt="tenant-a")
    hit_none, _ = admit(m, "n", tokens(0, 9))
    assert hit_b.num_tokens == 0 and hit_none.num_tokens == 0
    assert hit_a2.num_tokens == 8
    assert not set(m.block_table("a")) & set(m.block_table("b"))


def test_free_is_idempotent_and_one_path_for_every_reason():
    m = KVCacheManager(8, BS)
    for reason in FreeReason:
        admit(m, reason.value, tokens(0, 5))
        assert m.free(reason.value, reason) == 2
        assert m.free(reason.value, reason) == 0
    assert m.counters.redundant_frees == len(FreeReason)
    assert m.counters.frees_by_reason == dict.fromkeys(FreeReason, 1)
    assert m.check_idle().ok


def test_decode_allocates_one_block_at_a_boundary_and_commits_it():
    m = KVCacheManager(8, BS)
    admit(m, "a", tokens(0, 7))
    for token in (7, 8):
        m.append_token_ids("a", [token])
        assert m.allocate_slots("a", 1) is not None
        m.commit("a", len(m.ledger.get("a").token_ids))  # type: ignore[union-attr]
    assert m.block_table("a") == [0, 1, 2]
    assert m.pool.blocks[1].is_cached  # tokens 4..7 completed by decode
    assert not m.pool.blocks[2].is_cached


def test_chunked_prefill_publishes_blocks_only_after_commit():
    m = KVCacheManager(8, BS)
    m.add_request("a", tokens(0, 12))
    assert m.allocate_slots("a", 6) is not None
    assert not m.pool.cached  # allocated, KV not yet written
    m.commit("a", 6)
    assert len(m.pool.cached) == 1
    assert m.allocate_slots("a", 6) is not None
    m.commit("a", 12)
    assert len(m.pool.cached) == 3


def test_commit_and_allocate_reject_impossible_counts():
    m = KVCacheManager(8, BS)
    m.add_request("a", tokens(0, 6))
    with pytest.raises(ValueError, match="cannot allocate"):
        m.allocate_slots("a", 7)
    assert m.allocate_slots("a", 4) is not None
    with pytest.raises(ValueError, match="outside"):
        m.commit("a", 5)
    with pytest.raises(UnknownRequest):
        m.lookup("nobody")
    with pytest.raises(ValueError, match="already in the cache"):
        m.add_request("a", [1])


def test_hash_collision_is_refused_by_the_token_recheck():
    m = KVCacheManager(8, BS)
    admit(m, "a", tokens(0, 5))
    block = m.pool.blocks[0]
    block.token_bytes = b"forged"  # same hash, other tokens: what a collision would look like
    m.add_request("b", tokens(0, 5))
    assert m.lookup("b").num_tokens == 0
    assert m.counters.hash_collisions == 1


def test_verify_names_request_block_and_epochs():
    m = KVCacheManager(4, BS)
    admit(m, "a", tokens(0, 6))
    m.verify("a")
    m.pool.blocks[1].epoch += 1  # as if the block were handed to someone else
    with pytest.raises(CacheCorruption) as info:
        m.verify("a")
    err = info.value
    assert (err.request_id, err.block_id, err.expected_epoch, err.actual_epoch) == ("a", 1, 1, 2)
    assert m.counters.corruption_detections == 1


def test_verify_checks_content_checksums_when_fed():
    m = KVCacheManager(4, BS)
    admit(m, "a", tokens(0, 6))
    m.record_checksum(0, 0xABC)
    m.verify("a", {0: 0xABC})
    with pytest.raises(CacheCorruption, match="checksum"):
        m.verify("a", {0: 0xDEF})


def test_reaper_frees_idle_requests_and_counts_reclaimed_blocks(clock):
    m = KVCacheManager(8, BS, clock=clock)
    admit(m, "stuck", tokens(0, 9))
    clock.now += 5
    admit(m, "busy", tokens(100, 3))
    clock.now += 30
    m.append_token_ids("busy", [7])
    assert m.reap(idle_timeout_s=20) == ["stuck"]
    assert m.counters.reclaimed_blocks == 3 and m.counters.reaped_requests == 1
    assert m.has_request("busy") and not m.has_request("stuck")
    assert m.audit(live_request_ids={"busy"}).ok


def test_events_follow_written_blocks_exactly():
    m = KVCacheManager(3, BS, enable_events=True)
    admit(m, "a", tokens(0, 9))
    events = m.drain_events()
    assert [type(e) for e in events] == [BlockStored, BlockStored]
    first, second = events
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.parent_block_hash is None and second.parent_block_hash == first.block_hashes[0]
    assert second.token_ids == (4, 5, 6, 7) and second.block_size == BS
    m.free("a")
    admit(m, "b", tokens(100, 3))
    assert m.drain_events() == []  # the free partial block went first
    m.free("b")
    m.add_request("c", tokens(200, 8))
    assert m.allocate_slots("c", 8) is not None
    assert m.drain_events() == [BlockRemoved(second.block_hashes)]
    m.free("c")
    assert m.reset_prefix_cache()
    assert m.drain_events() == [AllBlocksCleared()]
    assert not m.pool.cached


def test_usage_counts_cached_free_blocks_as_free():
    m = KVCacheManager(10, BS)
    admit(m, "a", tokens(0, 8))
    assert m.stats().usage == pytest.approx(0.2)
    m.free("a")
    stats = m.stats()
    assert stats.usage == 0.0 and stats.num_cached_free_blocks == 2
    assert stats.num_free_blocks == 10


def test_reset_is_refused_while_blocks_are_held():
    m = KVCacheManager(4, BS)
    admit(m, "a", tokens(0, 4))
    assert not m.reset_prefix_cache()
    assert m.pool.cached


def test_prefix_caching_off_never_hits_and_never_publishes():
    m = KVCacheManager(8, BS, enable_prefix_caching=False)
    admit(m, "a", tokens(0, 9))
    hit, _ = admit(m, "b", tokens(0, 9))
    assert hit.num_tokens == 0 and not m.pool.cached
    assert m.stats().counters.prefix_queries_tokens == 0


def test_stale_prefix_hit_is_refused():
    m = KVCacheManager(3, BS)
    admit(m, "a", tokens(0, 5))
    m.free("a")
    m.add_request("b", tokens(0, 5))
    hit = m.lookup("b")
    admit(m, "c", tokens(100, 12))  # evicts the block the hit points at
    m.free("c")
    with pytest.raises(ValueError, match="stale prefix hit"):
        m.allocate_slots("b", 1, hit)


def test_chained_hashes_equal_block_by_block_hashing():
    from kvserve.kvcache.hashing import ROOT_HASH, chain_hashes, encode_tokens, hash_block

    toks = list(range(12))
    hashes, chunks = chain_hashes(ROOT_HASH, encode_tokens(toks), 4 * 8, b"salt")
    parent, expected = ROOT_HASH, []
    for i in range(3):
        extra = b"salt" if i == 0 else b""
        parent = hash_block(parent, encode_tokens(toks[4 * i : 4 * i + 4]), extra)
        expected.append(parent)
    assert hashes == expected and chunks[1] == encode_tokens(toks[4:8])


def test_blocks_being_computed_are_announced_until_committed_or_freed():
    m = KVCacheManager(16, BS)
    prompt = tokens(0, 13)  # three full blocks
    m.add_request("first", prompt)
    assert m.allocate_slots("first", 13) is not None
    m.add_request("second", prompt)
    pending = m.lookup("second")
    assert (pending.num_tokens, pending.num_pending_tokens) == (0, 12)
    m.commit("first", 8)  # two blocks written: they are hits now, the third is still pending
    hit = m.lookup("second")
    assert (hit.num_tokens, hit.num_pending_tokens) == (8, 4)
    assert m.audit().ok
    m.free("first", FreeReason.ABORTED)  # never finished: nothing is pending any more
    assert m.lookup("second").num_pending_tokens == 0 and not m.pending
    assert m.audit(live_request_ids={"second"}).ok
