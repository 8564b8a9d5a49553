"""The idle check from counts (O(live)): silent on a clean idle cache, and every planted leak
is still caught, with the culprit named by the full audit it escalates to. The scenarios run
unpatched too, so a test can only fail for the planted reason."""

from __future__ import annotations

import pytest

from kvserve.kvcache import FreeReason, KVCacheManager, ViolationKind
from kvserve.kvcache.host_tier import HostTier
from kvserve.kvcache.idle_check import quick_idle_report
from tests.kvcache.planted_scenarios import play
from tests.kvcache.test_planted_host_tier import fresh
from tests.kvcache.test_planted_leaks import free_ignoring_aborts


def _drained(forget_r2: bool = False):
    eng, rest = play("abort_mid_prefill", 2, forget_r2=forget_r2)
    leaked = eng.table("r2")
    for step in rest:
        step()
    return eng, leaked


def _quick_alone(mgr: KVCacheManager):
    return quick_idle_report(mgr.pool, mgr.ledger, mgr.pending, mgr.transfers)


def test_a_clean_idle_cache_passes_from_counts_alone() -> None:
    eng, _ = _drained()
    runs = eng.mgr.stats().counters.audit_runs
    quick = eng.mgr.check_idle_quick()
    assert quick.ok, quick.describe()
    counters = eng.mgr.stats().counters
    assert counters.audit_runs == runs and counters.idle_checks == 1  # no full audit ran
    full = eng.mgr.check_idle()
    census = ("num_blocks", "num_free_uncached", "num_free_cached", "num_held",
              "num_live_requests")
    assert [getattr(quick, k) for k in census] == [getattr(full, k) for k in census]
    assert quick.num_free_cached > 0  # the scenario leaves cached blocks behind


@pytest.mark.parametrize("how", ["manager_free_skips_aborted", "engine_never_calls_free"])
def test_a_request_left_in_the_ledger_is_caught_and_named(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    if how == "manager_free_skips_aborted":
        free_ignoring_aborts(monkeypatch)
    eng, leaked = _drained(forget_r2=how == "engine_never_calls_free")
    quick = _quick_alone(eng.mgr)
    assert quick.kinds() == {ViolationKind.LEAK, ViolationKind.HELD_WHILE_IDLE}
    assert [v.request_id for v in quick.violations if v.kind is ViolationKind.LEAK] == ["r2"]
    report = eng.mgr.check_idle_quick()
    assert report.kinds() == {ViolationKind.LEAK, ViolationKind.HELD_WHILE_IDLE}
    held = next(v for v in report.violations if v.kind is ViolationKind.HELD_WHILE_IDLE)
    assert all(str(b) in held.message for b in leaked)  # the full audit named the blocks
    assert eng.mgr.stats().counters.audit_failures >= 1


def test_blocks_leaked_past_the_ledger_are_caught_from_the_free_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def free(self: KVCacheManager, request_id: str, reason: FreeReason = FreeReason.FINISHED):
        record = self.ledger.pop(request_id)  # BUG: the ledger forgets, the pool is never told
        return len(record.block_table) if record is not None else 0

    monkeypatch.setattr(KVCacheManager, "free", free)
    eng, leaked = _drained()
    assert _quick_alone(eng.mgr).kinds() == {ViolationKind.HELD_WHILE_IDLE}
    report = eng.mgr.check_idle_quick()
    mismatched = {v.block_id for v in report.violations
                  if v.kind is ViolationKind.REFCOUNT_MISMATCH}
    assert set(leaked) <= mismatched


def test_a_pin_never_released_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    eng, steps = fresh()
    for step in steps:
        step()
    assert eng.mgr.stats().host.counters.loads > 0 and eng.mgr.check_idle_quick().ok
    monkeypatch.setattr(HostTier, "unpin", lambda self, slot_id: None)  # BUG: pins stay
    eng, steps = fresh()
    for step in steps:
        step()
    assert ViolationKind.HOST_PIN_MISMATCH in _quick_alone(eng.mgr).kinds()
    assert ViolationKind.HOST_PIN_MISMATCH in eng.mgr.check_idle_quick().kinds()


def test_a_drifted_count_the_full_audit_cannot_see_is_kept() -> None:
    eng, _ = _drained()
    eng.mgr.pool.num_cached_free += 1  # BUG: a count no longer matches the map
    report = eng.mgr.check_idle_quick()
    assert report.kinds() == {ViolationKind.FREE_QUEUE_BROKEN}
    assert "free cached blocks" in report.violations[0].message
