"""Blocks in flight: a request planned into a step shares the prompt blocks that step writes."""

from __future__ import annotations

import pytest

from kvserve.kvcache import FreeReason, KVCacheManager

BS = 4


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def writer_and_joiner(m: KVCacheManager, joiner_prompt: list[int], writer_chunk: int = 13,
                      joiner_salt: str | None = None):
    m.add_request("writer", tokens(0, 13))  # three full blocks, then one token
    assert m.allocate_slots("writer", writer_chunk) is not None
    m.add_request("joiner", joiner_prompt, cache_salt=joiner_salt)


def test_a_joiner_shares_the_blocks_its_writer_computes_in_the_same_step():
    m = KVCacheManager(16, BS)
    writer_and_joiner(m, tokens(0, 12) + [99, 98])
    assert m.lookup("joiner").num_pending_tokens == 12  # without the step's plan: wait
    hit = m.lookup("joiner", in_flight={"writer": 13})
    assert (hit.num_tokens, hit.num_in_flight_tokens, hit.num_pending_tokens) == (12, 12, 0)
    assert hit.in_flight_owners == ("writer",)
    allocation = m.allocate_slots("joiner", 2, hit)
    assert allocation is not None and allocation.num_cached_tokens == 12
    shared = m.block_table("writer")[:3]
    assert m.block_table("joiner")[:3] == shared
    assert [m.pool.blocks[b].ref_cnt for b in shared] == [2, 2, 2]
    assert all(m.pool.blocks[b].block_hash is None for b in shared)  # not published yet
    # The step ran: the writer publishes, the joiner publishes nothing of the shared head.
    m.commit("writer", 13)
    m.commit("joiner", 14)
    assert all(m.pool.blocks[b].block_hash is not None for b in shared)
    assert len(m.pool.cached) == 3 and not m.pending
    assert m.audit().ok
    m.free("writer")
    m.free("joiner")
    assert m.check_idle().ok and m.stats().num_held_blocks == 0


def test_only_blocks_the_step_writes_whole_are_shared_the_rest_stays_pending():
    m = KVCacheManager(16, BS)
    writer_and_joiner(m, tokens(0, 12) + [99], writer_chunk=10)  # 2.5 blocks this step
    hit = m.lookup("joiner", in_flight={"writer": 10})
    assert (hit.num_tokens, hit.num_in_flight_tokens, hit.num_pending_tokens) == (8, 8, 4)


def test_a_joiner_after_a_cached_head_continues_into_the_blocks_in_flight():
    m = KVCacheManager(16, BS)
    m.add_request("first", tokens(0, 5))
    assert m.allocate_slots("first", 5) is not None
    m.commit("first", 5)  # block 0 cached
    m.add_request("writer", tokens(0, 13))
    writer_hit = m.lookup("writer")
    assert m.allocate_slots("writer", 9, writer_hit) is not None  # writes blocks 1 and 2
    m.add_request("joiner", tokens(0, 12) + [7])
    hit = m.lookup("joiner", in_flight={"writer": 13})
    assert (hit.num_tokens, hit.num_in_flight_tokens) == (12, 8)
    assert hit.block_ids == tuple(m.block_table("writer")[:3])


def test_tenants_never_share_blocks_in_flight():
    m = KVCacheManager(16, BS)
    writer_and_joiner(m, tokens(0, 12) + [99], joiner_salt="other-tenant")
    hit = m.lookup("joiner", in_flight={"writer": 13})
    assert (hit.num_tokens, hit.num_in_flight_tokens, hit.num_pending_tokens) == (0, 0, 0)


def test_a_request_not_planned_into_the_step_lends_nothing():
    m = KVCacheManager(16, BS)
    writer_and_joiner(m, tokens(0, 12) + [99])
    hit = m.lookup("joiner", in_flight={"someone-else": 13})
    assert (hit.num_tokens, hit.num_pending_tokens) == (0, 12)


def test_a_hit_whose_writer_left_is_refused_and_nothing_changes():
    m = KVCacheManager(16, BS)
    writer_and_joiner(m, tokens(0, 12) + [99])
    hit = m.lookup("joiner", in_flight={"writer": 13})
    m.free("writer", FreeReason.ABORTED)
    with pytest.raises(ValueError, match="stale prefix hit"):
        m.allocate_slots("joiner", 1, hit)
    assert m.block_table("joiner") == [] and m.stats().num_held_blocks == 0
    assert m.audit(live_request_ids={"joiner"}).ok
