"""Planted refcount bugs: each must be caught within a few steps, culprit named.

Pins: (a) eviction of a held block, (c) double free, (d) refcount off by one, (g) a prefix hit
touched before the capacity check. The harness (planted_harness.py) checks after every step with
`verify` and `audit`, plus all-or-nothing for refused allocations; the scenarios
(planted_scenarios.py) are also run unpatched here, so a test can only fail for the planted
reason.
"""

from __future__ import annotations

import re

import pytest

from kvserve.kvcache import FreeReason, KVCacheManager, ViolationKind
from kvserve.kvcache.block_pool import BlockPool
from tests.kvcache.planted_harness import caught, run_clean, snapshot
from tests.kvcache.planted_scenarios import SYS, assert_clean_without_the_bug, play


@pytest.mark.parametrize(
    "name", ["held_eviction", "refused_admission", "shared_prefix", "shared_prefix_r1_first"]
)
def test_scenario_is_clean_without_the_bug(name: str) -> None:
    assert_clean_without_the_bug(name)


# -- a. eviction of a held block ---------------------------------------------------------------


def test_a_eviction_of_held_block_is_named_by_verify_and_audit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = BlockPool.allocate

    def allocate_evicting_held(self: BlockPool, num_blocks: int, *args, **kwargs):
        # BUG: under pressure the last block is reclaimed from the lowest ids, refcount unchecked.
        out = original(self, num_blocks, *args, **kwargs)
        if not out or self.free_queue.num_free_blocks >= 2:
            return out
        victim = next((b for b in self.blocks if b not in out and b.ref_cnt > 0), None)
        if victim is None:
            return out
        spare = out.pop()
        spare.ref_cnt = 0
        self.free_queue.appendleft(spare)
        if victim.block_hash is not None:
            del self.cached[victim.block_hash]
            victim.clear_content()
        victim.epoch += 1
        victim.ref_cnt = 1
        out.append(victim)
        return out

    monkeypatch.setattr(BlockPool, "allocate", allocate_evicting_held)
    eng, rest = play("held_eviction", 2)
    victim = eng.table("r1")[0]
    seen_epoch = eng.mgr.pool.blocks[victim].epoch

    findings = caught(eng, rest, within=1)

    assert len(findings.corruptions) == 1, findings.describe()
    exc = findings.corruptions[0]
    assert (exc.request_id, exc.block_id) == ("r1", victim)
    assert (exc.expected_epoch, exc.actual_epoch) == (seen_epoch, seen_epoch + 1)
    assert f"request 'r1' block {victim}" in str(exc)
    assert findings.named(ViolationKind.EPOCH_MISMATCH) == {(victim, "r1")}
    assert findings.named(ViolationKind.UNCACHED_SHARE) == {(victim, "r2")}
    assert victim in {v.block_id for v in findings.violations(ViolationKind.REFCOUNT_MISMATCH)}
    assert eng.mgr.stats().counters.corruption_detections == 1


# -- c. double free ------------------------------------------------------------------------------


def _free_releasing_twice(monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    original = KVCacheManager.free

    def free(self: KVCacheManager, request_id: str, reason: FreeReason = FreeReason.FINISHED):
        record = self.ledger.get(request_id)
        table = list(record.block_table) if record is not None else []
        hits = table[: record.num_cached_tokens // self.block_size] if record is not None else []
        num = original(self, request_id, reason)
        # BUG: a second release, of the whole table or of the prefix-hit blocks kept on the side.
        self.pool.free(reversed(table if which == "whole_table" else hits))
        return num

    monkeypatch.setattr(KVCacheManager, "free", free)


@pytest.mark.parametrize(("which", "r1_first"), [("whole_table", False), ("prefix_hits", True)])
def test_c_double_free_assertion_names_the_block(
    monkeypatch: pytest.MonkeyPatch, which: str, r1_first: bool
) -> None:
    _free_releasing_twice(monkeypatch, which)
    eng, rest = play("shared_prefix", 3, r1_finishes_first=r1_first)
    r1_blocks, r2_blocks = eng.table("r1"), eng.table("r2")

    findings = caught(eng, rest, within=3)
    assert findings.error is not None, findings.describe()
    match = re.search(r"double free of KVBlock\(id=(\d+)", str(findings.error))
    assert match, str(findings.error)
    culprit = int(match.group(1))
    assert culprit in (r2_blocks[:2] if r1_first else r1_blocks + r2_blocks)


def test_c_double_free_of_a_shared_prefix_is_named_by_audit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """r2's prefix-hit blocks are released twice while r1 still holds them: no assertion fires
    (refcount 2 -> 0), so the audit must name the blocks and their rightful holder."""
    _free_releasing_twice(monkeypatch, "prefix_hits")
    eng, rest = play("shared_prefix", 3)
    shared = eng.table("r2")[:2]
    assert shared == eng.table("r1")[:2]

    findings = caught(eng, rest, within=1)
    assert findings.error is None
    assert findings.named(ViolationKind.REFCOUNT_MISMATCH) == {(b, "r1") for b in shared}
    # verify sees it too: r1's blocks were released under it.
    assert [(e.request_id, e.block_id) for e in findings.corruptions] == [("r1", shared[0])]


def test_c_engine_freeing_twice_is_a_counted_no_op() -> None:
    eng, rest = play("shared_prefix", 4)
    before = snapshot(eng.mgr)
    assert eng.mgr.free("r2", FreeReason.ABORTED) == 0
    after = snapshot(eng.mgr)
    assert [key for key in before if before[key] != after[key]] == ["stats"]
    assert eng.mgr.stats().counters.redundant_frees == 1
    run_clean(eng, rest)


# -- d. refcount off by one --------------------------------------------------------------------


def _miscount(monkeypatch: pytest.MonkeyPatch, method: str, delta: int) -> None:
    """Plant an off-by-one: `BlockPool.<method>` moves each block's refcount by `delta` more."""
    original = getattr(BlockPool, method)

    def miscounting(self: BlockPool, blocks, *args, **kwargs) -> None:
        blocks = list(blocks)
        original(self, blocks, *args, **kwargs)
        for block in blocks:
            block.ref_cnt += delta

    monkeypatch.setattr(BlockPool, method, miscounting)


def test_d_touch_counting_twice_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    _miscount(monkeypatch, "touch", +1)  # BUG: a hit takes two references
    eng, rest = play("shared_prefix", 1)
    shared = eng.table("r1")[:2]

    findings = caught(eng, rest, within=1)
    assert findings.named(ViolationKind.REFCOUNT_MISMATCH) == {(b, "r1") for b in shared}
    assert all("refcount 3 but 2 holders" in v.message for v in findings.report.violations)


def test_d_free_dropping_two_references_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    _miscount(monkeypatch, "free", -1)  # BUG: each release drops two references
    eng, rest = play("shared_prefix", 3)
    r2_blocks, shared = eng.table("r2"), eng.table("r1")[:2]

    findings = caught(eng, rest, within=1)
    mismatched = findings.violations(ViolationKind.REFCOUNT_MISMATCH)
    assert {v.block_id for v in mismatched} == set(r2_blocks)
    assert {(b, "r1") for b in shared} <= findings.named(ViolationKind.REFCOUNT_MISMATCH)
    # r2's own blocks went to refcount -1 inside the free queue; the shared ones to 0 outside it.
    assert {v.block_id for v in findings.violations(ViolationKind.HELD_BLOCK_IN_FREE_QUEUE)} == (
        set(r2_blocks) - set(shared)
    )
    assert {v.block_id for v in findings.violations(ViolationKind.LOST_BLOCK)} == set(shared)


def test_d_idle_check_reports_negative_refcounts(monkeypatch: pytest.MonkeyPatch) -> None:
    _miscount(monkeypatch, "free", -1)  # BUG: each release drops two references
    eng, rest = play("held_eviction", 0)  # two requests that share nothing, then both finish
    for step in rest:
        step()
    idle = eng.mgr.check_idle()  # the audit "never raises"
    assert ViolationKind.HELD_WHILE_IDLE in idle.kinds(), idle.describe()
    assert ViolationKind.REFCOUNT_MISMATCH in idle.kinds()


# -- g. hits touched before the capacity check ------------------------------------------------


def test_g_touch_before_capacity_check_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    original = KVCacheManager.allocate_slots

    def allocate_slots(self: KVCacheManager, request_id: str, num_new_tokens: int, prefix_hit=None):
        hits = []
        if prefix_hit is not None and prefix_hit.block_ids and not self.block_table(request_id):
            hits = [self.pool.blocks[i] for i in prefix_hit.block_ids]
            self.pool.touch(hits)  # BUG: the hit is taken before we know the rest fits
        out = original(self, request_id, num_new_tokens, prefix_hit)
        if out is not None:
            for block in hits:
                block.ref_cnt -= 1  # the success path is correct: one reference per hit block
        return out

    monkeypatch.setattr(KVCacheManager, "allocate_slots", allocate_slots)
    eng, rest = play("refused_admission", 3)
    eng.mgr.add_request("probe", [*SYS, 0])
    hit_blocks = list(eng.mgr.lookup("probe").block_ids)
    eng.mgr.free("probe")
    assert len(hit_blocks) == 2

    findings = caught(eng, rest, within=1)
    assert {v.block_id for v in findings.violations(ViolationKind.REFCOUNT_MISMATCH)} == set(
        hit_blocks
    )
    assert len(findings.all_or_nothing) == 1
    assert all(f"({b}, 0, 1)" in findings.all_or_nothing[0] for b in hit_blocks)
