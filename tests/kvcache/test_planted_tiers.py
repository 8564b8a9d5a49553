"""Planted bugs in the disk tier and in swapping: a disk slot readable before its copy was
confirmed, a disk slot reassigned under the load reading it, a swapped-out request's host slots
leaked when it ends. Each must be caught by `verify` or the audit within the step that plants
it, naming the culprit. The scenarios also run unpatched, so a test can only fail for the
planted reason.
"""

from __future__ import annotations

import pytest

from kvserve.kvcache import FreeReason, ViolationKind
from kvserve.kvcache.host_tier import HostSlot, SlotPool, SlotState
from kvserve.kvcache.transfers import TransferLedger
from tests.kvcache.planted_harness import Engine, Step, caught, run_clean

A = list(range(1, 10))  # 2 full blocks + 1 token
B = list(range(100, 113))  # 3 full blocks + 1 token
C = list(range(200, 213))


def demote_then_return(eng: Engine) -> list[Step]:
    """A 4-block pool over a 2-slot host and a 2-slot disk: B's admission evicts A into the
    host, C's evicts B into the host and A on to the disk (full); A comes back and loads both
    blocks from the disk while its allocation evicts C's blocks, and in the same pass E's
    evicts C's last one: their demotions find every disk slot pinned by A's loads."""
    return [
        lambda: (eng.add("a", A), eng.admit("a"), eng.finish("a")),
        lambda: (eng.add("b", B), eng.admit("b"), eng.finish("b")),
        lambda: (eng.add("c", C), eng.allocate("c", len(C))),  # demotions scheduled
        lambda: (eng.run_copies(), eng.mgr.commit("c", len(C)), eng.finish("c")),
        lambda: (eng.add("a2", A), eng.allocate("a2", 1, eng.mgr.lookup("a2"))),  # disk loads
        lambda: (eng.add("e", C[:3]), eng.allocate("e", 3)),
        lambda: (eng.run_copies(), eng.mgr.commit("a2", len(A)), eng.finish("a2"),
                 eng.mgr.commit("e", 3), eng.finish("e")),
    ]


def swap_then_abort(eng: Engine) -> list[Step]:
    """X (2 blocks) is computed, swapped out (its copies run), and aborted while swapped out."""
    return [
        lambda: (eng.add("x", A[:8]), eng.admit("x")),
        lambda: (eng.mgr.swap_out("x"), eng.run_copies()),
        lambda: eng.finish("x", FreeReason.ABORTED),
    ]


def fresh(scenario) -> tuple[Engine, list[Step]]:
    eng = Engine(4, num_host_slots=2, num_disk_slots=2)
    return eng, scenario(eng)


def test_the_scenarios_are_clean_and_use_the_disk_and_swapping_without_a_bug() -> None:
    eng, steps = fresh(demote_then_return)
    run_clean(eng, steps)
    disk = eng.mgr.stats().disk
    assert (disk.counters.stores, disk.counters.loads, disk.counters.hit_tokens) == (2, 2, 8)
    assert disk.counters.dropped_stores > 0  # demotions while both disk slots were pinned
    assert eng.mgr.check_idle().ok
    eng, steps = fresh(swap_then_abort)
    run_clean(eng, steps)
    assert eng.mgr.stats().host.counters.swapped_out_blocks == 2
    assert eng.mgr.check_idle().ok


def test_a_disk_slot_made_ready_before_its_copy_is_confirmed_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = SlotPool.reserve

    def reserve_ready(self: SlotPool, *args: object) -> HostSlot | None:
        slot = original(self, *args)  # type: ignore[arg-type]
        if slot is not None and self.name == "disk":  # BUG: readable before the copy ran
            del self.storing[slot.block_hash]
            slot.state = SlotState.READY
            self.lru[slot.block_hash] = slot
        return slot

    monkeypatch.setattr(SlotPool, "reserve", reserve_ready)
    eng, steps = fresh(demote_then_return)
    findings = caught(eng, steps, within=3)
    culprits = findings.violations(ViolationKind.HOST_READABLE_BEFORE_COPY)
    assert {" ".join(v.message.split()[:3]) for v in culprits} == {"disk slot 0", "disk slot 1"}
    assert all("before the copy completed" in v.message for v in culprits)


def test_a_pinned_disk_slot_evicted_under_its_load_is_caught_in_that_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A2's pins come before its own evictions, so the bug reassigns a disk slot between the
    pin and the load being scheduled: the load's own check refuses it there and then (a slot
    reassigned after its load was scheduled is `verify`'s: test_disk_tier.py)."""
    # BUG: the victim is the least recently used READY slot, pinned or not.
    monkeypatch.setattr(SlotPool, "_victim", lambda self: next(iter(self.lru.values()), None))
    eng, steps = fresh(demote_then_return)
    findings = caught(eng, steps, within=5)
    assert isinstance(findings.error, AssertionError)
    assert "loading from HostSlot(id=1, storing, epoch=2, pins=1" in str(findings.error)
    assert eng.mgr.transfers.disk.slots[1].pin_cnt == 1  # the pin did not protect it


def test_a_swapped_out_request_s_leaked_slots_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    # BUG: ending a swapped-out request forgets to release its private host slots.
    monkeypatch.setattr(TransferLedger, "release_swap", lambda self, slots: None)
    eng, steps = fresh(swap_then_abort)
    findings = caught(eng, steps, within=3)
    leaks = findings.violations(ViolationKind.LEAK)
    assert {v.request_id for v in leaks} == {"x"}
    assert {v.message.split()[2] for v in leaks} == {"0", "1"}  # both swap slots
    assert all("does not list it" in v.message for v in leaks)
