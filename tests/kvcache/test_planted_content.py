"""Planted content bugs: a block whose KV is not what its hash says must be caught and named,
and never served as a prefix hit.

Pins: (e) a stale hash after reuse, (f) the tenant salt left out of the hash, (h) a hash
published before the KV is written, (i) a block reused without a new epoch under a stashed
prefix hit. The scenarios are also run unpatched here (a stashed stale hit is refused even
without a bug), so a test can only fail for the planted reason.
"""

from __future__ import annotations

import pytest

import kvserve.kvcache.manager as manager_module
from kvserve.kvcache import KVCacheManager, PrefixHit, ViolationKind
from kvserve.kvcache.block_pool import BlockPool
from tests.kvcache.planted_harness import caught
from tests.kvcache.planted_scenarios import (
    P1,
    P2,
    assert_clean_without_the_bug,
    assert_stale_hit_refused,
    play,
)


@pytest.mark.parametrize(
    "name", ["chunked_prefill_allocated_ahead", "reuse_after_finish", "two_tenants"]
)
def test_scenario_is_clean_without_the_bug(name: str) -> None:
    assert_clean_without_the_bug(name)


def test_stashed_hit_scenario_is_refused_without_the_bug() -> None:
    eng, (allocate_with_stashed_hit,) = play("stashed_hit", -1)
    assert_stale_hit_refused(eng, allocate_with_stashed_hit)


# -- e. stale hash after reuse ----------------------------------------------------------------


def _evict_forgetting(monkeypatch: pytest.MonkeyPatch, what: str) -> None:
    original = BlockPool._evict

    def evict_keeping_everything(self: BlockPool, block, *args, **kwargs) -> None:
        return None  # BUG: the evicted block keeps its hash, tokens and map entry

    def evict_keeping_map_entry(self: BlockPool, block, *args, **kwargs) -> None:
        key = block.block_hash
        mapped = self.cached.get(key)
        original(self, block, *args, **kwargs)
        if mapped is block:
            self.cached[key] = block  # BUG: the map entry outlives the eviction

    replacement = evict_keeping_everything if what == "content_and_map" else evict_keeping_map_entry
    monkeypatch.setattr(BlockPool, "_evict", replacement)


@pytest.mark.parametrize(
    ("what", "kind"),
    [("content_and_map", ViolationKind.STALE_HASH), ("map_entry", ViolationKind.HASH_MAP_MISMATCH)],
)
def test_e_stale_hash_after_reuse_is_named(
    monkeypatch: pytest.MonkeyPatch, what: str, kind: ViolationKind
) -> None:
    _evict_forgetting(monkeypatch, what)
    eng, rest = play("reuse_after_finish", 3)
    reused = eng.mgr.pool.free_queue.block_ids()[0]  # r1's deepest cached block: next to evict

    findings = caught(eng, rest, within=1)
    assert eng.table("r2")[-1] == reused
    expected = {(reused, "r2")} if kind is ViolationKind.STALE_HASH else {(reused, None)}
    assert findings.named(kind) == expected, findings.describe()


@pytest.mark.parametrize("what", ["content_and_map", "map_entry"])
def test_e_lookup_never_serves_a_reused_block(monkeypatch: pytest.MonkeyPatch, what: str) -> None:
    _evict_forgetting(monkeypatch, what)
    eng, _ = play("reuse_after_finish", 3)
    eng.allocate("r2", 4)  # r2 now owns r1's old deepest block and is writing it
    reused = eng.table("r2")[-1]
    eng.add("r3", P1)
    hit = eng.mgr.lookup("r3")
    assert reused not in hit.block_ids, f"lookup served block {reused}, now r2's, as r1's prefix"
    counters = eng.mgr.stats().counters
    assert counters.corruption_detections + counters.hash_collisions == 1  # the refusal is seen


# -- f. salt left out of the hash ---------------------------------------------------------------


def test_f_cross_tenant_share_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    original = manager_module.encode_extra_keys
    # BUG: the salt (last extra key) never reaches the hash.
    monkeypatch.setattr(manager_module, "encode_extra_keys",
                        lambda model, adapter, salt: original(model, adapter, None))
    eng, rest = play("two_tenants", 1)
    tenant_a_prefix = eng.table("a1")[:2]

    findings = caught(eng, rest, within=1)
    assert findings.named(ViolationKind.CROSS_TENANT_SHARE) == {(b, "b1") for b in tenant_a_prefix}


def test_f_tenants_without_the_bug_get_no_cross_tenant_hit() -> None:
    eng, _ = play("two_tenants", 1)
    eng.add("b1", P2, salt="tenant-b")
    assert eng.mgr.lookup("b1").num_tokens == 0
    eng.add("a2", P2, salt="tenant-a")
    assert eng.mgr.lookup("a2").block_ids == tuple(eng.table("a1")[:2])


# -- h. a hash published before the KV is written -------------------------------------------


def test_h_hash_published_before_kv_written_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    original = KVCacheManager.commit

    def commit(self: KVCacheManager, request_id: str, num_computed_tokens: int) -> None:
        record = self.ledger.get(request_id)
        if record is None:
            return original(self, request_id, num_computed_tokens)
        # BUG: every allocated full block is published, written or not.
        upto = min(len(record.block_table) * self.block_size, len(record.token_ids))
        original(self, request_id, upto)
        record.num_computed_tokens = num_computed_tokens

    monkeypatch.setattr(KVCacheManager, "commit", commit)
    eng, rest = play("chunked_prefill_allocated_ahead", 0)
    findings = caught(eng, rest, within=1)
    unwritten = eng.table("r1")[1:3]  # tokens 4..11: slots allocated, KV not yet written
    assert findings.named(ViolationKind.STALE_HASH) == {(b, "r1") for b in unwritten}
    assert all("uncommitted tokens" in v.message for v in findings.report.violations)


# -- i. (extra) a block reused without a new epoch, under a stashed prefix hit -------------------


def _allocate_keeping_epochs(monkeypatch: pytest.MonkeyPatch) -> None:
    original = BlockPool.allocate

    def allocate_keeping_epochs(self: BlockPool, num_blocks: int, *args, **kwargs):
        epochs = [b.epoch for b in self.blocks]
        out = original(self, num_blocks, *args, **kwargs)
        for block in out or ():
            block.epoch = epochs[block.block_id]  # BUG: the block is handed on at its old epoch
        return out

    monkeypatch.setattr(BlockPool, "allocate", allocate_keeping_epochs)


def test_i_stale_hit_is_refused_even_when_reuse_keeps_the_epoch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """r3's admission reuses a block of r2's stashed hit without bumping its epoch, so the epochs
    still match; allocate_slots must still refuse the hit (it re-checks the hashes) and change
    nothing, and r2's fresh lookup must stop short of r3's block."""
    _allocate_keeping_epochs(monkeypatch)
    stash: dict[str, PrefixHit] = {}
    eng, (allocate_with_stashed_hit,) = play("stashed_hit", -1, stash=stash)
    r3_unwritten = eng.table("r3")[-1]  # r3 committed 16 of 17 tokens: its last block is unwritten
    assert r3_unwritten in stash["r2"].block_ids
    assert [eng.mgr.pool.blocks[b].epoch for b in stash["r2"].block_ids] == list(
        stash["r2"].epochs
    ), "the planted bug should leave the epochs looking fresh"

    assert_stale_hit_refused(eng, allocate_with_stashed_hit)
    assert r3_unwritten not in eng.mgr.lookup("r2").block_ids
