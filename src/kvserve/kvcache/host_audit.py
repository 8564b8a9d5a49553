"""The host tier's audit: its books balance too, in O(num_slots + in-flight copies).

Checks the tier's own invariants (conservation of slots, one index per state, LRU keys that
match their slots' hashes and tokens), that nothing is readable before its copy was confirmed,
that pins equal the in-flight loads plus the imports' pins (kvserve.kvcache.imports), that
every in-flight load still targets the block its request holds under the request's own salt,
that an attached import belongs to a live request, and that no slot is held while the engine is
idle (except by an import whose transfer is still open).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

from kvserve.kvcache.audit import HostCensus, Violation, ViolationKind
from kvserve.kvcache.hashing import hash_block
from kvserve.kvcache.host_tier import SlotState
from kvserve.kvcache.imports import ImportState, KVImports
from kvserve.kvcache.ledger import Ledger
from kvserve.kvcache.transfers import TransferLedger


def audit_host_tier(
    transfers: TransferLedger,
    ledger: Ledger,
    live_request_ids: Collection[str] | None = None,
    imports: KVImports | None = None,
) -> tuple[list[Violation], HostCensus]:
    """Audit the host tier behind `transfers` against the request `ledger` and the open
    `imports`. Never mutates."""
    host = transfers.host
    import_pins = imports.pins() if imports is not None else Counter[int]()
    import_reserved = imports.reservations() if imports is not None else {}
    out: list[Violation] = []

    def fail(kind: ViolationKind, msg: str, req: str | None = None) -> None:
        out.append(Violation(kind, msg, None, req))

    # Conservation: every slot is in exactly the index its state names.
    free_ids = list(host.free_ids)
    if len(set(free_ids)) != len(free_ids):
        fail(ViolationKind.HOST_TIER_BROKEN, f"a slot is listed free twice: {free_ids[:8]}")
    if len(free_ids) + len(host.storing) + len(host.lru) != host.num_slots:
        fail(ViolationKind.HOST_TIER_BROKEN,
             f"{len(free_ids)} free + {len(host.storing)} storing + {len(host.lru)} ready "
             f"!= {host.num_slots} slots")
    free_set = set(free_ids)
    states = Counter(slot.state for slot in host.slots)
    for slot in host.slots:
        sid, key = slot.slot_id, slot.block_hash
        if (slot.state is SlotState.FREE) != (sid in free_set):
            fail(ViolationKind.HOST_TIER_BROKEN,
                 f"host slot {sid} is {slot.state.value} but "
                 f"{'is' if sid in free_set else 'is not'} in the free list")
        if slot.state is SlotState.FREE and (key is not None or slot.pin_cnt):
            fail(ViolationKind.HOST_TIER_BROKEN,
                 f"free host slot {sid} keeps a hash or {slot.pin_cnt} pins")
        index = host.storing if slot.state is SlotState.STORING else host.lru
        if slot.state is not SlotState.FREE and (key is None or index.get(key) is not slot):
            fail(ViolationKind.HOST_TIER_BROKEN,
                 f"host slot {sid} is {slot.state.value} but its index does not give it its hash")

    # Hash entries describe their slots: key, tokens and (past the root) the chained hash itself.
    for key, slot in host.lru.items():
        if slot.state is not SlotState.READY or slot.block_hash != key or slot.token_bytes is None:
            fail(ViolationKind.HOST_HASH_MISMATCH,
                 f"host LRU hash {key.hex()[:12]} maps to {slot}, which is not READY under it")
        elif slot.parent_hash is not None and hash_block(slot.parent_hash,
                                                         slot.token_bytes) != key:
            fail(ViolationKind.HOST_HASH_MISMATCH,
                 f"host slot {slot.slot_id}'s tokens and parent do not hash to {key.hex()[:12]}")
    for key, slot in host.storing.items():
        if slot.state is not SlotState.STORING or slot.block_hash != key:
            fail(ViolationKind.HOST_TIER_BROKEN,
                 f"host storing hash {key.hex()[:12]} maps to {slot}, which is not storing it")

    # A slot whose copy is scheduled is STORING at the epoch the copy was scheduled for, and
    # every STORING slot has a scheduled copy (or it would never be confirmed: lost).
    for sid, epoch in transfers.stores.items():
        slot = host.slots[sid]
        if slot.state is not SlotState.STORING or slot.epoch != epoch:
            fail(ViolationKind.HOST_READABLE_BEFORE_COPY,
                 f"host slot {sid} is {slot.state.value} at epoch {slot.epoch}, but its copy "
                 f"(epoch {epoch}) is not confirmed: it could be read before the copy completed")
    for slot in host.storing.values():
        if slot.slot_id not in transfers.stores and slot.slot_id not in import_reserved:
            fail(ViolationKind.HOST_TIER_BROKEN,
                 f"host slot {slot.slot_id} is storing but no copy or import into it is "
                 "scheduled")
    for sid, epoch in import_reserved.items():
        slot = host.slots[sid]
        if slot.state is not SlotState.STORING or slot.epoch != epoch or sid in transfers.stores:
            fail(ViolationKind.HOST_READABLE_BEFORE_COPY,
                 f"host slot {sid} is {slot.state.value} at epoch {slot.epoch}, but an import "
                 f"reserved it at epoch {epoch} and has not confirmed it")

    # Pins equal the in-flight loads plus the imports' pins; each load still reads its slot and
    # writes its block.
    pins = Counter(load.host_slot for load in transfers.loads.values())
    for slot in host.slots:
        sid = slot.slot_id
        if slot.pin_cnt != pins[sid] + import_pins[sid]:
            fail(ViolationKind.HOST_PIN_MISMATCH,
                 f"host slot {sid} has {slot.pin_cnt} pins but {pins[sid]} in-flight loads "
                 f"read it and {import_pins[sid]} imports hold it")
        elif slot.pin_cnt and slot.state is not SlotState.READY:
            fail(ViolationKind.HOST_PIN_MISMATCH,
                 f"host slot {slot.slot_id} is pinned by {slot.pin_cnt} loads but is "
                 f"{slot.state.value}: a pinned slot was given new content")
    for load in transfers.loads.values():
        rid, slot = load.request_id, host.slots[load.host_slot]
        record = ledger.get(rid)
        if slot.state is not SlotState.READY or slot.epoch != load.host_epoch:
            fail(ViolationKind.HOST_LOAD_MISMATCH,
                 f"request {rid!r} loads host slot {slot.slot_id} at epoch {load.host_epoch}, "
                 f"but the slot is {slot.state.value} at epoch {slot.epoch}", rid)
        if record is None:
            fail(ViolationKind.HOST_LOAD_MISMATCH,
                 f"a load into block {load.block_id} is in flight for request {rid!r}, which "
                 "is gone", rid)
            continue
        table = record.block_table
        idx = load.block_idx
        block = table[idx] if idx < len(table) else None
        if block is None or block.block_id != load.block_id or block.epoch != load.block_epoch:
            fail(ViolationKind.HOST_LOAD_MISMATCH,
                 f"request {rid!r} loads into block {load.block_id} (epoch {load.block_epoch}) "
                 f"at position {idx}, but its table holds {block!r} there", rid)
        elif block.block_hash is not None:
            fail(ViolationKind.HOST_LOAD_MISMATCH,
                 f"block {block.block_id} is published before its load was confirmed", rid)
        if idx < len(record.block_hashes) and record.block_hashes[idx] != slot.block_hash:
            fail(ViolationKind.HOST_LOAD_MISMATCH,
                 f"request {rid!r} loads host slot {slot.slot_id} whose hash is not its "
                 f"block {idx}'s", rid)
        elif slot.state is SlotState.READY and slot.salt != record.salt:
            fail(ViolationKind.CROSS_TENANT_SHARE,
                 f"host slot {slot.slot_id} was stored under salt {slot.salt!r} but request "
                 f"{rid!r} loads it under salt {record.salt!r}", rid)

    # An attached import belongs to a live request, or nobody will ever release it.
    for import_id, imp in (imports.imports.items() if imports is not None else ()):
        if (live_request_ids is not None and imp.state is ImportState.ATTACHED
                and import_id not in live_request_ids):
            fail(ViolationKind.IMPORT_LEAK,
                 f"import {import_id!r} holds {len(imp.pinned)} host slots for a request that "
                 "is not live", import_id)

    # Idle: nothing may be storing or pinned when no request is live, except by an open import
    # (its transfer is still running and owns its slots).
    num_pinned = sum(1 for slot in host.slots if slot.pin_cnt)
    open_slots = {sid for imp in (imports.imports.values() if imports is not None else ())
                  if imp.state is ImportState.OPEN for sid in (*imp.pinned, *imp.reserved)}
    held = {s.slot_id for s in host.slots if s.pin_cnt or s.state is SlotState.STORING}
    if live_request_ids is not None and not live_request_ids and held - open_slots:
        fail(ViolationKind.HELD_WHILE_IDLE,
             f"no request is live but {len(host.storing)} host slots are storing and "
             f"{num_pinned} pinned ({len(open_slots)} of them by open imports)")

    census = HostCensus(host.num_slots, states[SlotState.FREE], states[SlotState.STORING],
                        states[SlotState.READY], num_pinned)
    return out, census
