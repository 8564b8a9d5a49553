"""The tiers' audit: their books balance too, in O(num_slots + in-flight copies).

For the host tier and the disk tier alike: the tier's own invariants (conservation of slots, one
index per state, LRU keys that match their slots' hashes and tokens), that nothing is readable
before its copy was confirmed, that pins equal the in-flight loads, that every in-flight load
still targets the block its request holds under the request's own salt, and that no slot is
held while the engine is idle. For the host tier also the swap slots (each private slot belongs
to a live request that lists it at its epoch, SWAPPING exactly while its copy is unconfirmed)
and the imports (kvserve.kvcache.imports): pins equal the in-flight loads plus the imports'
pins, an attached import belongs to a live request, and only an import whose transfer is still
open may hold slots while the engine is idle.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace

from kvserve.kvcache.audit import AuditReport, HostCensus, Violation, ViolationKind
from kvserve.kvcache.hashing import hash_block
from kvserve.kvcache.host_tier import SlotPool, SlotState
from kvserve.kvcache.imports import ImportState, KVImports
from kvserve.kvcache.ledger import Ledger
from kvserve.kvcache.transfers import LoadSource, PendingLoad, TransferLedger


def audit_tiers(report: AuditReport, transfers: TransferLedger, ledger: Ledger,
                live_request_ids: Collection[str] | None = None,
                imports: KVImports | None = None) -> AuditReport:
    """`report` (the device pool's audit) with the host and disk tiers' findings and census
    added (`imports`: KV received from prefill workers, into the host tier). Never mutates."""
    out: list[Violation] = []
    host = audit_tier(transfers.host, transfers.stores, LoadSource.HOST, transfers, ledger,
                      live_request_ids, out, imports)
    out += audit_swaps(transfers, ledger, live_request_ids)
    if imports is not None:
        out += audit_imports(imports, live_request_ids)
    disk = None if transfers.disk is None else audit_tier(
        transfers.disk, transfers.disk_stores, LoadSource.DISK, transfers, ledger,
        live_request_ids, out)
    return replace(report, violations=report.violations + tuple(out), host=host, disk=disk)


def audit_tier(pool: SlotPool, stores: Mapping[int, int], source: LoadSource,
               transfers: TransferLedger, ledger: Ledger,
               live_request_ids: Collection[str] | None, out: list[Violation],
               imports: KVImports | None = None) -> HostCensus:
    """Append the tier `pool`'s violations to `out` (`stores`: its scheduled copies in, slot
    -> epoch; `source`: what its prefix-hit loads are tagged; `imports`: the host tier's
    imports, whose reservations and pins count as scheduled); return its census."""
    name = pool.name
    import_pins = imports.pins() if imports is not None else Counter[int]()
    import_reserved = imports.reservations() if imports is not None else {}

    def fail(kind: ViolationKind, msg: str, req: str | None = None) -> None:
        out.append(Violation(kind, msg, None, req))

    # Conservation: every slot is in exactly the index its state names.
    free_ids = list(pool.free_ids)
    if len(set(free_ids)) != len(free_ids):
        fail(ViolationKind.HOST_TIER_BROKEN, f"a {name} slot is listed free twice: {free_ids[:8]}")
    indexed = len(free_ids) + len(pool.storing) + len(pool.lru) + len(pool.private)
    if indexed != pool.num_slots:
        fail(ViolationKind.HOST_TIER_BROKEN,
             f"{len(free_ids)} free + {len(pool.storing)} storing + {len(pool.lru)} ready + "
             f"{len(pool.private)} swap {name} slots != {pool.num_slots} slots")
    free_set = set(free_ids)
    states = Counter(slot.state for slot in pool.slots)
    for slot in pool.slots:
        sid, key, state = slot.slot_id, slot.block_hash, slot.state
        if (state is SlotState.FREE) != (sid in free_set):
            fail(ViolationKind.HOST_TIER_BROKEN,
                 f"{name} slot {sid} is {state.value} but "
                 f"{'is' if sid in free_set else 'is not'} in the free list")
        if state is SlotState.FREE and (key is not None or slot.pin_cnt or slot.owner):
            fail(ViolationKind.HOST_TIER_BROKEN,
                 f"free {name} slot {sid} keeps a hash, an owner or {slot.pin_cnt} pins")
        if state in (SlotState.SWAPPING, SlotState.SWAPPED):
            if pool.private.get(sid) is not slot:
                fail(ViolationKind.HOST_TIER_BROKEN,
                     f"{name} slot {sid} is {state.value} but not indexed as a swap slot")
            continue
        index = pool.storing if state is SlotState.STORING else pool.lru
        if state is not SlotState.FREE and (key is None or index.get(key) is not slot):
            fail(ViolationKind.HOST_TIER_BROKEN,
                 f"{name} slot {sid} is {state.value} but its index does not give it its hash")

    # Hash entries describe their slots: key, tokens and (past the root) the chained hash itself.
    for key, slot in pool.lru.items():
        if slot.state is not SlotState.READY or slot.block_hash != key or slot.token_bytes is None:
            fail(ViolationKind.HOST_HASH_MISMATCH,
                 f"{name} LRU hash {key.hex()[:12]} maps to {slot}, which is not READY under it")
        elif slot.parent_hash is not None and hash_block(slot.parent_hash,
                                                         slot.token_bytes) != key:
            fail(ViolationKind.HOST_HASH_MISMATCH,
                 f"{name} slot {slot.slot_id}'s tokens and parent do not hash to {key.hex()[:12]}")
    for key, slot in pool.storing.items():
        if slot.state is not SlotState.STORING or slot.block_hash != key:
            fail(ViolationKind.HOST_TIER_BROKEN,
                 f"{name} storing hash {key.hex()[:12]} maps to {slot}, which is not storing it")

    # A slot whose copy is scheduled is STORING at the epoch the copy was scheduled for, and
    # every STORING slot has a scheduled copy (or it would never be confirmed: lost).
    for sid, epoch in stores.items():
        slot = pool.slots[sid]
        if slot.state is not SlotState.STORING or slot.epoch != epoch:
            fail(ViolationKind.HOST_READABLE_BEFORE_COPY,
                 f"{name} slot {sid} is {slot.state.value} at epoch {slot.epoch}, but its copy "
                 f"(epoch {epoch}) is not confirmed: it could be read before the copy completed")
    for slot in pool.storing.values():
        if slot.slot_id not in stores and slot.slot_id not in import_reserved:
            fail(ViolationKind.HOST_TIER_BROKEN,
                 f"{name} slot {slot.slot_id} is storing but no copy or import into it is "
                 "scheduled")
    for sid, epoch in import_reserved.items():
        slot = pool.slots[sid]
        if slot.state is not SlotState.STORING or slot.epoch != epoch or sid in stores:
            fail(ViolationKind.HOST_READABLE_BEFORE_COPY,
                 f"{name} slot {sid} is {slot.state.value} at epoch {slot.epoch}, but an "
                 f"import reserved it at epoch {epoch} and has not confirmed it")

    # Pins equal the in-flight loads plus the imports' pins; each load still reads its slot and
    # writes its block.
    loads = [load for load in transfers.loads.values() if load.source is source]
    pins = Counter(load.host_slot for load in loads)
    for slot in pool.slots:
        sid = slot.slot_id
        if slot.pin_cnt != pins[sid] + import_pins[sid]:
            fail(ViolationKind.HOST_PIN_MISMATCH,
                 f"{name} slot {sid} has {slot.pin_cnt} pins but {pins[sid]} in-flight loads "
                 f"read it and {import_pins[sid]} imports hold it")
        elif slot.pin_cnt and slot.state is not SlotState.READY:
            fail(ViolationKind.HOST_PIN_MISMATCH,
                 f"{name} slot {slot.slot_id} is pinned by {slot.pin_cnt} loads but is "
                 f"{slot.state.value}: a pinned slot was given new content")
    for load in loads:
        _audit_load(load, transfers, ledger, fail)

    # Idle: nothing may be storing or pinned when no request is live, except by an open import
    # (its transfer is still running and owns its slots).
    num_pinned = sum(1 for slot in pool.slots if slot.pin_cnt)
    open_slots = {sid for imp in (imports.imports.values() if imports is not None else ())
                  if imp.state is ImportState.OPEN for sid in (*imp.pinned, *imp.reserved)}
    held = {s.slot_id for s in pool.slots if s.pin_cnt or s.state is SlotState.STORING}
    if live_request_ids is not None and not live_request_ids and held - open_slots:
        fail(ViolationKind.HELD_WHILE_IDLE,
             f"no request is live but {len(pool.storing)} {name} slots are storing and "
             f"{num_pinned} pinned ({len(open_slots)} of them by open imports)")
    return HostCensus(pool.num_slots, states[SlotState.FREE], states[SlotState.STORING],
                      states[SlotState.READY], num_pinned, len(pool.private))


def _audit_load(load: PendingLoad, transfers: TransferLedger, ledger: Ledger,
                fail: Callable[..., None]) -> None:
    """Report `load` if its slot or its block changed under it, or it crosses tenants."""
    rid, slot = load.request_id, transfers.tier(load.source).slots[load.host_slot]
    name = load.source.value
    if not transfers.is_readable(load):
        fail(ViolationKind.HOST_LOAD_MISMATCH,
             f"request {rid!r} loads {name} slot {slot.slot_id} at epoch {load.host_epoch}, "
             f"but the slot is {slot.state.value} at epoch {slot.epoch}", rid)
    record = ledger.get(rid)
    if record is None:
        fail(ViolationKind.HOST_LOAD_MISMATCH,
             f"a load into block {load.block_id} is in flight for request {rid!r}, which "
             "is gone", rid)
        return
    table, idx = record.block_table, load.block_idx
    block = table[idx] if idx < len(table) else None
    if block is None or block.block_id != load.block_id or block.epoch != load.block_epoch:
        fail(ViolationKind.HOST_LOAD_MISMATCH,
             f"request {rid!r} loads into block {load.block_id} (epoch {load.block_epoch}) "
             f"at position {idx}, but its table holds {block!r} there", rid)
    elif block.block_hash is not None:
        fail(ViolationKind.HOST_LOAD_MISMATCH,
             f"block {block.block_id} is published before its load was confirmed", rid)
    if load.source is LoadSource.SWAP:
        return  # a swap slot holds the request's own KV, under no hash (audit_swaps)
    if idx < len(record.block_hashes) and record.block_hashes[idx] != slot.block_hash:
        fail(ViolationKind.HOST_LOAD_MISMATCH,
             f"request {rid!r} loads {name} slot {slot.slot_id} whose hash is not its "
             f"block {idx}'s", rid)
    elif slot.state is SlotState.READY and slot.salt != record.salt:
        fail(ViolationKind.CROSS_TENANT_SHARE,
             f"{name} slot {slot.slot_id} was stored under salt {slot.salt!r} but request "
             f"{rid!r} loads it under salt {record.salt!r}", rid)


def audit_swaps(transfers: TransferLedger, ledger: Ledger,
                live_request_ids: Collection[str] | None) -> list[Violation]:
    """Every private host slot belongs to a live request that lists it at its epoch, and is
    SWAPPING exactly while its copy in is unconfirmed; every listed slot is that request's."""
    host, out = transfers.host, []
    live = None if live_request_ids is None else set(live_request_ids)
    listed: dict[int, tuple[str, int]] = {}
    for record in ledger:
        for slot_id, epoch in record.swap_slots:
            listed[slot_id] = (record.request_id, epoch)
            slot = host.slots[slot_id]
            if host.private.get(slot_id) is not slot or slot.owner != record.request_id or (
                    slot.epoch != epoch):
                out.append(Violation(
                    ViolationKind.SWAP_MISMATCH,
                    f"request {record.request_id!r} lists swap slot {slot_id} at epoch {epoch}, "
                    f"but the slot is {slot.state.value} at epoch {slot.epoch} for "
                    f"{slot.owner!r}", None, record.request_id))
    for slot_id, slot in host.private.items():
        owner = slot.owner
        if listed.get(slot_id) != (owner, slot.epoch) or (live is not None and owner not in live):
            out.append(Violation(
                ViolationKind.LEAK,
                f"swap slot {slot_id} is held for request {owner!r}, which "
                f"{'is not live' if listed.get(slot_id) else 'does not list it'}", None, owner))
        if (slot.state is SlotState.SWAPPING) != (transfers.swap_stores.get(slot_id)
                                                  == slot.epoch):
            out.append(Violation(
                ViolationKind.HOST_READABLE_BEFORE_COPY,
                f"swap slot {slot_id} is {slot.state.value} but its copy in is "
                f"{'unconfirmed' if slot_id in transfers.swap_stores else 'not scheduled'}",
                None, owner))
    for slot_id in transfers.swap_stores:
        if slot_id not in host.private:
            out.append(Violation(ViolationKind.HOST_TIER_BROKEN,
                                 f"a swap-out copy into host slot {slot_id} is scheduled, but "
                                 "the slot is no swap slot", None, None))
    return out


def audit_imports(imports: KVImports,
                  live_request_ids: Collection[str] | None) -> list[Violation]:
    """An attached import belongs to a live request, or nobody will ever release it."""
    if live_request_ids is None:
        return []
    return [Violation(ViolationKind.IMPORT_LEAK,
                      f"import {import_id!r} holds {len(imp.pinned)} host slots for a request "
                      "that is not live", None, import_id)
            for import_id, imp in imports.imports.items()
            if imp.state is ImportState.ATTACHED and import_id not in live_request_ids]
