"""Regression: the cached blocks that survive eviction always form contiguous prefix chains.

Pins a retried prompt: its twin blocks are cached on one attempt or the other (duplicates are
refused), then one is evicted; no cached block may outlive its parent (an orphan).
"""

from __future__ import annotations

from kvserve.kvcache import KVCacheManager
from tests.kvcache.conftest import FakeClock


def test_surviving_prefix_is_a_contiguous_head_after_a_retried_prompt() -> None:
    mgr = KVCacheManager(8, 2, clock=FakeClock())
    prompt = [1, 2, 3, 4, 5, 6, 7]
    # A client retries while its first attempt is still running: same prompt, no hit yet.
    for rid in ("first", "retry"):
        mgr.add_request(rid, prompt)
        assert mgr.lookup(rid).num_tokens == 0
    assert mgr.allocate_slots("first", 7) is not None
    assert mgr.allocate_slots("retry", 4) is not None
    mgr.commit("first", 4)  # caches the two head blocks
    mgr.commit("retry", 4)  # duplicates: refused, stay uncached
    assert mgr.allocate_slots("retry", 3) is not None
    mgr.commit("retry", 7)  # its third block is cached, chained to first's head
    mgr.commit("first", 7)  # duplicate of retry's third block: refused
    mgr.free("first")
    mgr.free("retry")
    mgr.add_request("other", [9] * 12)
    assert mgr.allocate_slots("other", 12) is not None  # 6 blocks: evicts exactly one cached block
    assert mgr.audit(live_request_ids={"other"}).ok
    cached = mgr.pool.cached
    orphans = [
        b.block_id
        for b in cached.values()
        if b.parent_hash is not None and b.parent_hash not in cached
    ]
    assert not orphans, f"cached blocks {orphans} survive their evicted parent"
