"""Planted leaks: a free that is skipped or only half done must be caught and named.

Pins (b): the manager skipping the free on abort, the engine never calling free, and a free that
drops the ledger entry but never tells the pool. The leaked request and its blocks must be named
by the audit at once and by the idle check later, and the reaper must reclaim them. The
scenario is also run unpatched here, so a test can only fail for the planted reason.
"""

from __future__ import annotations

import pytest

from kvserve.kvcache import FreeReason, KVCacheManager, ViolationKind
from tests.kvcache.planted_harness import Engine, Findings, Step, caught, named
from tests.kvcache.planted_scenarios import assert_clean_without_the_bug, play


@pytest.mark.parametrize("name", ["abort_mid_prefill"])
def test_scenario_is_clean_without_the_bug(name: str) -> None:
    assert_clean_without_the_bug(name)


def free_ignoring_aborts(monkeypatch: pytest.MonkeyPatch) -> None:
    original = KVCacheManager.free

    def free(self: KVCacheManager, request_id: str, reason: FreeReason = FreeReason.FINISHED):
        if reason is FreeReason.ABORTED:
            return 0  # BUG: the abort path returns early and releases nothing
        return original(self, request_id, reason)

    monkeypatch.setattr(KVCacheManager, "free", free)


@pytest.mark.parametrize("how", ["manager_free_skips_aborted", "engine_never_calls_free"])
def test_b_leaked_request_is_named_with_its_blocks(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    if how == "manager_free_skips_aborted":
        free_ignoring_aborts(monkeypatch)
    eng, rest = play("abort_mid_prefill", 2, forget_r2=how == "engine_never_calls_free")
    leaked = eng.table("r2")

    findings = caught(eng, rest, within=1)
    (leak,) = findings.violations(ViolationKind.LEAK)
    assert (leak.request_id, leak.block_id) == ("r2", leaked[0])
    assert str(leaked) in leak.message

    for step in rest[1:]:  # the engine carries on until it is idle
        step()
    idle = eng.mgr.check_idle()
    assert idle.kinds() == {ViolationKind.LEAK, ViolationKind.HELD_WHILE_IDLE}, idle.describe()
    assert named(idle.violations) >= {(leaked[0], "r2")}
    held_while_idle = next(v for v in idle.violations if v.kind is ViolationKind.HELD_WHILE_IDLE)
    assert held_while_idle.block_id in leaked
    assert all(str(b) in held_while_idle.message for b in leaked)

    # The reaper reclaims what the dead request left, and counts it.
    eng.clock.now += 301
    assert eng.mgr.reap(idle_timeout_s=300) == ["r2"]
    assert eng.mgr.stats().counters.reclaimed_blocks == len(leaked)
    assert eng.mgr.check_idle().ok


def _leak_past_the_ledger(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[Engine, list[Step], list[int], Findings]:
    """r2 is aborted through a free that drops its ledger entry but never tells the pool; returns
    the engine, the steps left, r2's leaked blocks and what the checks saw at the abort."""

    def free(self: KVCacheManager, request_id: str, reason: FreeReason = FreeReason.FINISHED):
        record = self.ledger.pop(request_id)  # BUG: the ledger forgets, the pool is never told
        return len(record.block_table) if record is not None else 0

    monkeypatch.setattr(KVCacheManager, "free", free)
    eng, rest = play("abort_mid_prefill", 2)
    leaked = eng.table("r2")
    findings = caught(eng, rest, within=1)
    return eng, rest[1:], leaked, findings


def test_b_blocks_leaked_past_the_ledger_are_caught_and_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    eng, rest, leaked, findings = _leak_past_the_ledger(monkeypatch)
    r1_blocks = eng.table("r1")
    mismatched = {v.block_id for v in findings.violations(ViolationKind.REFCOUNT_MISMATCH)}
    assert mismatched == set(leaked)

    for step in rest:
        step()
    idle = eng.mgr.check_idle()
    assert ViolationKind.HELD_WHILE_IDLE in idle.kinds(), idle.describe()
    # r1 has also gone through the broken free, so its blocks are stranded too.
    assert {v.block_id for v in idle.violations if v.kind is ViolationKind.REFCOUNT_MISMATCH} == (
        set(leaked) | set(r1_blocks)
    )


def test_b_blocks_leaked_past_the_ledger_still_name_the_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the ledger entry gone, the blocks' last owner is the only witness left."""
    eng, _, leaked, findings = _leak_past_the_ledger(monkeypatch)
    for violation in findings.violations(ViolationKind.REFCOUNT_MISMATCH):
        assert violation.request_id == "r2" or "'r2'" in violation.message, violation
    unshared = [b for b in leaked if b not in eng.table("r1")]
    assert findings.named(ViolationKind.REFCOUNT_MISMATCH) >= {(b, "r2") for b in unshared}
