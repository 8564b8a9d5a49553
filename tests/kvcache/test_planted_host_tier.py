"""Planted host-tier bugs: a copy readable before it completed, a pinned slot evicted under its
load, a loaded block published before its copy ran. Each must be caught by `verify` or the
audit within the step that plants it, naming the culprit. The scenarios also run unpatched, so a
test can only fail for the planted reason.
"""

from __future__ import annotations

import pytest

from kvserve.kvcache import KVCacheManager, ViolationKind
from kvserve.kvcache.host_tier import HostSlot, HostTier, SlotState
from kvserve.kvcache.publishing import publish
from tests.kvcache.planted_harness import Engine, Step, caught, run_clean

A = list(range(1, 10))  # 2 full blocks + 1 token
B = list(range(100, 132))  # 8 full blocks: takes the whole device pool


def evict_then_return(eng: Engine) -> list[Step]:
    """A finishes; B's admission evicts A's prefix into the host tier (2 slots); B finishes; A
    comes back and loads its prefix from the host while its allocation evicts B's blocks."""
    return [
        lambda: (eng.add("a", A), eng.admit("a")),
        lambda: eng.finish("a"),
        lambda: (eng.add("b", B), eng.allocate("b", len(B))),  # the offloads are scheduled
        lambda: (eng.run_copies(), eng.mgr.commit("b", len(B)), eng.finish("b")),
        lambda: (eng.add("a2", A), eng.allocate("a2", 1, eng.mgr.lookup("a2"))),  # loads
        lambda: (eng.run_copies(), eng.mgr.commit("a2", len(A)), eng.finish("a2")),
    ]


def load_under_pressure(eng: Engine) -> list[Step]:
    """A's prefix is in the host tier (B evicted it, then was aborted unwritten); A comes back
    and loads it, and in the same pass C's admission evicts D's cached block: the host tier is
    full and both its slots are pinned by A's loads."""
    return [
        lambda: (eng.add("a", A), eng.admit("a"), eng.finish("a")),
        lambda: (eng.add("d", A[:1] + B[:7]), eng.admit("d"), eng.finish("d")),
        lambda: (eng.add("b", B), eng.allocate("b", len(B)), eng.run_copies(), eng.finish("b")),
        lambda: (eng.add("a2", A), eng.allocate("a2", 1, eng.mgr.lookup("a2"))),
        lambda: (eng.add("c", B[:24]), eng.allocate("c", 24)),
        lambda: (eng.run_copies(), eng.mgr.commit("a2", len(A)), eng.finish("a2"),
                 eng.mgr.commit("c", 24), eng.finish("c")),
    ]


SCENARIOS = {"evict_then_return": (8, evict_then_return),
             "load_under_pressure": (10, load_under_pressure)}


def fresh(name: str = "evict_then_return") -> tuple[Engine, list[Step]]:
    num_blocks, scenario = SCENARIOS[name]
    eng = Engine(num_blocks, num_host_slots=2)
    return eng, scenario(eng)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_scenario_is_clean_and_uses_the_host_tier_without_a_bug(name: str) -> None:
    eng, steps = fresh(name)
    run_clean(eng, steps)
    host = eng.mgr.stats().host
    assert (host.counters.stores, host.counters.loads, host.counters.hit_tokens) == (2, 2, 8)
    assert host.counters.dropped_stores > 0  # evictions while both slots were pinned
    idle = eng.mgr.check_idle()
    assert idle.ok, idle.describe()


def test_a_slot_made_ready_before_its_copy_is_confirmed_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = HostTier.reserve

    def reserve_ready(self: HostTier, *args: object) -> HostSlot | None:
        slot = original(self, *args)  # type: ignore[arg-type]
        if slot is not None:  # BUG: readable at once, before the model copied anything into it
            del self.storing[slot.block_hash]
            slot.state = SlotState.READY
            self.lru[slot.block_hash] = slot
        return slot

    monkeypatch.setattr(HostTier, "reserve", reserve_ready)
    eng, steps = fresh()
    findings = caught(eng, steps, within=3)
    culprits = findings.violations(ViolationKind.HOST_READABLE_BEFORE_COPY)
    assert {v.message.split()[2] for v in culprits} == {"0", "1"}  # both reserved slots
    assert all("before the copy completed" in v.message for v in culprits)


def test_a_pinned_slot_evicted_under_its_load_is_refused_before_the_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # BUG: the victim is the least recently used READY slot, pinned or not.
    monkeypatch.setattr(HostTier, "_victim", lambda self: next(iter(self.lru.values()), None))
    eng, steps = fresh("load_under_pressure")
    findings = caught(eng, steps, within=5)
    assert findings.error is None, findings.describe()
    corruption = findings.corruptions[0]
    assert corruption.request_id == "a2" and "host slot" in corruption.detail
    assert corruption.block_id in eng.table("a2")[:2]
    assert findings.named(ViolationKind.HOST_LOAD_MISMATCH) >= {(None, "a2")}
    assert ViolationKind.HOST_PIN_MISMATCH in findings.report.kinds()


def test_a_loaded_block_published_before_its_copy_ran_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = KVCacheManager.allocate_slots

    def allocate_publishing_loads(self: KVCacheManager, request_id: str, *args: object):
        out = original(self, request_id, *args)  # type: ignore[arg-type]
        record = self.ledger.get(request_id)
        for load in self.transfers.loads_of(request_id) if out is not None else ():
            publish(self.pool, record, load.block_idx)  # BUG: hit-able before the KV is there
        return out

    monkeypatch.setattr(KVCacheManager, "allocate_slots", allocate_publishing_loads)
    eng, steps = fresh()
    findings = caught(eng, steps, within=5)
    assert findings.named(ViolationKind.HOST_LOAD_MISMATCH) == {(None, "a2")}
    assert all("published before its load" in v.message
               for v in findings.violations(ViolationKind.HOST_LOAD_MISMATCH))
