"""Exact states of KV imported from a prefill worker: host slots reserved, confirmed and pinned by
the import, released at admission (the loads pin them then), at the request's end or on cancel;
the audit names an import nobody will release, and the reaper reclaims it."""

from __future__ import annotations

import pytest

from kvserve.kvcache import FreeReason, ImportState, KVCacheManager, ViolationKind
from kvserve.kvcache.host_tier import SlotState

BS = 4
PROMPT = list(range(10, 23))  # 13 tokens: 3 full blocks may be imported, the last token never


def manager(num_host_slots: int = 4) -> KVCacheManager:
    return KVCacheManager(num_blocks=8, block_size=BS, num_host_slots=num_host_slots,
                          model_id="m")


def slots(m: KVCacheManager) -> list[tuple[SlotState, int]]:
    return [(s.state, s.pin_cnt) for s in m.transfers.host.slots]


def import_all(m: KVCacheManager, rid: str, tokens: list[int] = PROMPT) -> None:
    """Open an import and take in every planned block (the engine thread's part of a pull)."""
    plan = m.imports.open(rid, tokens, None)
    for offset, block_hash in enumerate(plan.block_hashes):
        grant = m.imports.reserve(rid, plan.first_block + offset, block_hash)
        assert grant is not None and grant.needs_write
        m.imports.confirm(rid, grant)


def kinds(m: KVCacheManager, live: set[str]) -> set[ViolationKind]:
    return m.audit(live_request_ids=live).kinds()


def test_reserve_then_confirm_pins_the_slot_and_the_open_import_is_not_idle_leak() -> None:
    m = manager()
    plan = m.imports.open("r", PROMPT, None)
    assert (plan.first_block, plan.num_blocks) == (0, 3)
    grant = m.imports.reserve("r", 0, plan.block_hashes[0])
    assert grant is not None and (grant.slot_id, grant.needs_write) == (0, True)
    assert slots(m)[0] == (SlotState.STORING, 0)  # reserved: never readable
    assert m.transfers.host.get(plan.block_hashes[0], b"") is None
    assert m.audit(live_request_ids=()).ok  # the open transfer owns its reservation
    m.imports.confirm("r", grant)
    assert slots(m) == [(SlotState.READY, 1), (SlotState.FREE, 0), (SlotState.FREE, 0),
                        (SlotState.FREE, 0)]
    assert m.check_idle().ok, m.check_idle().describe()


def test_admission_turns_the_import_into_loads_and_releases_its_pins() -> None:
    m = manager()
    import_all(m, "r")
    m.imports.attach("r")
    assert m.imports.imports["r"].state is ImportState.ATTACHED
    m.add_request("r", PROMPT)
    hit = m.lookup("r")
    assert (hit.num_tokens, hit.host_slots) == (12, (0, 1, 2))
    assert m.allocate_slots("r", 1, hit) is not None
    assert "r" not in m.imports.imports
    assert [pins for _, pins in slots(m)[:3]] == [1, 1, 1]  # the loads' pins, not the import's
    assert m.audit(live_request_ids={"r"}).ok
    m.complete_transfers(m.take_transfers())
    m.commit("r", len(PROMPT))
    m.free("r")
    assert slots(m)[:3] == [(SlotState.READY, 0)] * 3
    assert m.check_idle().ok


def test_blocks_held_locally_are_skipped() -> None:
    m = manager()
    m.add_request("warm", PROMPT[:9])  # computes (and caches) the first 2 blocks
    assert m.allocate_slots("warm", 9) is not None
    m.commit("warm", 9)
    m.free("warm")
    plan = m.imports.open("r", PROMPT, None)
    assert (plan.first_block, plan.num_blocks) == (2, 1)
    salted = m.imports.open("other-tenant", PROMPT, "salt")
    assert (salted.first_block, salted.num_blocks) == (0, 3)  # another salt shares nothing


def test_out_of_order_or_foreign_blocks_are_refused_without_change() -> None:
    m = manager()
    plan = m.imports.open("r", PROMPT, None)
    with pytest.raises(ValueError, match="expects block 0"):
        m.imports.reserve("r", 1, plan.block_hashes[1])
    with pytest.raises(ValueError, match="hashes other tokens"):
        m.imports.reserve("r", 0, plan.block_hashes[1])
    assert slots(m) == [(SlotState.FREE, 0)] * 4


def test_no_room_returns_none_and_changes_nothing() -> None:
    m = manager(num_host_slots=2)
    import_all(m, "a", list(range(100, 109)))  # two blocks: both slots pinned
    plan = m.imports.open("b", PROMPT, None)
    before = slots(m)
    assert m.imports.reserve("b", 0, plan.block_hashes[0]) is None
    assert slots(m) == before
    assert m.imports.imports["b"].num_received == 0


def test_cancel_frees_reserved_slots_and_unpins_confirmed_ones() -> None:
    m = manager()
    plan = m.imports.open("r", PROMPT, None)
    first = m.imports.reserve("r", 0, plan.block_hashes[0])
    assert first is not None
    m.imports.confirm("r", first)
    assert m.imports.reserve("r", 1, plan.block_hashes[1]) is not None
    assert slots(m)[:2] == [(SlotState.READY, 1), (SlotState.STORING, 0)]
    assert m.imports.cancel("r") == 2
    assert slots(m)[:2] == [(SlotState.READY, 0), (SlotState.FREE, 0)]
    assert m.imports.cancel("r") == 0  # idempotent
    assert m.imports.num_cancelled == 1
    assert m.check_idle().ok


def test_a_block_another_import_landed_meanwhile_is_pinned_not_rewritten() -> None:
    m = manager()
    twin = m.imports.open("b", PROMPT, None)  # opened while nothing was held here
    import_all(m, "a")
    grant = m.imports.reserve("b", 0, twin.block_hashes[0])
    assert grant is not None and (grant.slot_id, grant.needs_write) == (0, False)
    assert slots(m)[0] == (SlotState.READY, 2)  # pinned by both imports
    m.imports.release("a")
    assert m.imports.open("c", PROMPT, None).num_blocks == 0  # all held now: nothing to fetch
    assert m.audit(live_request_ids=()).ok


def test_request_end_before_admission_releases_the_import() -> None:
    m = manager()
    import_all(m, "r")
    m.imports.attach("r")
    m.free("r", FreeReason.ABORTED)  # aborted while waiting: never in the ledger
    assert "r" not in m.imports.imports
    assert [pins for _, pins in slots(m)] == [0, 0, 0, 0]
    assert m.check_idle().ok


def test_the_audit_names_an_attached_import_whose_request_is_gone_and_reap_reclaims_it() -> None:
    m = manager()
    import_all(m, "r")
    m.imports.attach("r")
    assert m.audit(live_request_ids={"r"}).ok
    assert ViolationKind.IMPORT_LEAK in kinds(m, set())
    assert m.reap(live_request_ids=set()) == []  # no ledger record, but the import is reaped
    assert "r" not in m.imports.imports
    assert (m.imports.num_cancelled, m.counters.reclaimed_blocks) == (1, 0)  # slots, not blocks
    assert m.check_idle().ok


def test_the_audit_catches_pins_nobody_accounts_for() -> None:
    m = manager()
    import_all(m, "r")
    del m.imports.imports["r"]  # a bug: the import forgotten, its pins never released
    report = m.check_idle()
    assert {ViolationKind.HOST_PIN_MISMATCH, ViolationKind.HELD_WHILE_IDLE} <= report.kinds()


def test_an_idle_import_is_reaped_after_the_timeout() -> None:
    now = [0.0]
    m = KVCacheManager(num_blocks=8, block_size=BS, num_host_slots=4, clock=lambda: now[0])
    import_all(m, "r")
    now[0] = 5.0
    m.reap(idle_timeout_s=10.0)
    assert "r" in m.imports.imports
    now[0] = 20.0
    m.reap(idle_timeout_s=10.0)
    assert "r" not in m.imports.imports
    assert [pins for _, pins in slots(m)] == [0, 0, 0, 0]


def test_an_import_over_a_disk_tier_evicts_host_slots_without_demoting_them() -> None:
    """An import writes its host slots at once, outside any step; a demotion of the slot it
    took would be copied at the next step and read the import's bytes under the old hash."""
    m = KVCacheManager(num_blocks=8, block_size=BS, num_host_slots=3, num_disk_slots=4,
                       model_id="m")
    import_all(m, "a")
    m.imports.cancel("a")  # its three blocks stay as ordinary READY host cache
    assert [s.state for s in m.transfers.host.slots] == [SlotState.READY] * 3
    import_all(m, "b", [t + 100 for t in PROMPT])  # a full host tier: three evictions
    assert m.transfers.host.counters.evictions == 3
    assert not m.transfers.disk_stores and not m.transfers.disk.storing  # dropped, not demoted
    m.imports.cancel("b")
    assert m.check_idle_quick().ok and m.check_idle().ok, m.check_idle().describe()
