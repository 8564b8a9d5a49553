"""KV imported from another worker (disaggregated prefill): host slots from reserved to pinned.

A decode worker that pulls a prompt's KV from a prefill worker opens an import named by the
engine request id it will run: `open` says which full prompt blocks it already holds (device
pool or host tier, by chained hash under the tenant's salt) and which it must receive. Each
received block is `reserve`d (a STORING host slot: never readable), written by the model layer,
then `confirm`ed: READY, and pinned by the import so no eviction takes it before its request is
admitted. The request's normal host-tier hit then loads the blocks; admission (or the request's
end, or `cancel`) releases the import's pins. Pure bookkeeping, single-threaded like the manager.
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.exports import prompt_record
from kvserve.kvcache.host_tier import HostTier, SlotState
from kvserve.kvcache.ledger import RequestRecord


class ImportState(enum.Enum):
    """OPEN: blocks are arriving, the transfer owns the import. ATTACHED: its request is queued
    in the engine, which releases the import at admission or at the request's end."""

    OPEN = "open"
    ATTACHED = "attached"


@dataclass(frozen=True, slots=True)
class ImportPlan:
    """What an import needs: full prompt blocks `[first_block, first_block + len(block_hashes))`
    (their chained hashes); the blocks before `first_block` are held locally already."""

    import_id: str
    first_block: int
    block_hashes: tuple[bytes, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)


@dataclass(slots=True)
class KVImport:
    """One import's books: the prompt's hashes, its reserved slots (slot -> epoch, STORING) and
    its pinned READY slots, in block order."""

    record: RequestRecord
    plan: ImportPlan
    state: ImportState = ImportState.OPEN
    reserved: dict[int, int] = field(default_factory=dict)
    pinned: list[int] = field(default_factory=list)
    num_received: int = 0  # blocks accepted so far (reserved, or already kept and pinned)

    @property
    def next_block(self) -> int:
        return self.plan.first_block + self.num_received


@dataclass(frozen=True, slots=True)
class SlotGrant:
    """Where block `block_idx` goes: write its KV into `slot_id` then confirm, unless
    `needs_write` is False (the host tier already keeps that block; it is pinned as is)."""

    block_idx: int
    slot_id: int
    epoch: int
    needs_write: bool


class KVImports:
    """Every open or attached import over one host tier. Contract: an import's slots are either
    STORING (reserved, listed in `reserved`) or READY and pinned once by it (listed in `pinned`);
    `cancel` and `release` return them (idempotent) and never free a slot another reader pins."""

    def __init__(self, pool: BlockPool, host: HostTier, model_id: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.host = host
        self.model_id = model_id
        self.imports: dict[str, KVImport] = {}
        self.last_active: dict[str, float] = {}
        self._clock = clock
        self.num_cancelled = 0  # imports cancelled (failed transfers, aborts, reaped)

    def open(self, import_id: str, token_ids: Sequence[int], cache_salt: str | None,
             adapter_digest: bytes | None = None) -> ImportPlan:
        """Start an import of the prompt `token_ids` (run under the LoRA adapter of
        `adapter_digest`, None: the base model: it is in every block's key). The leading full
        blocks already held here are skipped; the last prompt token is always computed locally
        (its logits are needed), so at most `(len(token_ids) - 1) // block_size` blocks are
        ever imported."""
        if import_id in self.imports:
            raise ValueError(f"import {import_id!r} is already open")
        if not token_ids:
            raise ValueError("an import needs a prompt of at least one token")
        bs = self.pool.block_size
        max_blocks = (len(token_ids) - 1) // bs
        record = prompt_record(import_id, token_ids, cache_salt, self.model_id, bs, max_blocks,
                               adapter_digest)
        first = 0
        while first < max_blocks and self._is_held(record, first):
            first += 1
        plan = ImportPlan(import_id, first, tuple(record.block_hashes[first:max_blocks]))
        self.imports[import_id] = KVImport(record, plan)
        self.last_active[import_id] = self._clock()
        return plan

    def reserve(self, import_id: str, block_idx: int, block_hash: bytes) -> SlotGrant | None:
        """A slot for the import's next block, which must be `block_idx` with `block_hash` (else
        ValueError: the sender is out of order or hashes another prompt). None, changing
        nothing, when the host tier has no slot to give (every slot storing or pinned) or the
        block is being stored by someone else: the rest of the prompt is computed locally."""
        imp = self._get(import_id)
        if imp.state is not ImportState.OPEN:
            raise ValueError(f"import {import_id!r} is {imp.state.value}: it takes no blocks")
        plan, record = imp.plan, imp.record
        if block_idx != imp.next_block or imp.num_received >= plan.num_blocks:
            raise ValueError(f"import {import_id!r} expects block {imp.next_block} of "
                             f"[{plan.first_block}, {plan.first_block + plan.num_blocks}), "
                             f"got block {block_idx}")
        if block_hash != record.block_hashes[block_idx]:
            raise ValueError(f"block {block_idx} of import {import_id!r} has hash "
                             f"{block_hash.hex()[:12]}, expected "
                             f"{record.block_hashes[block_idx].hex()[:12]}: the sender hashes "
                             "other tokens, salt or model")
        token_bytes = record.block_token_bytes[block_idx]
        self.last_active[import_id] = self._clock()
        kept = self.host.get(block_hash, token_bytes)
        if kept is not None:
            self.host.pin(kept)
            imp.pinned.append(kept.slot_id)
            imp.num_received += 1
            return SlotGrant(block_idx, kept.slot_id, kept.epoch, needs_write=False)
        if self.host.contains(block_hash):
            return None  # STORING for someone else (an offload, another import)
        parent = record.block_hashes[block_idx - 1] if block_idx else None
        # Written now, outside the step's copies: an evicted slot is dropped, not demoted to the
        # disk tier (that copy would run at the next step and read this import's bytes).
        slot = self.host.reserve(block_hash, parent, token_bytes, record.salt, demote=False)
        if slot is None:
            return None
        imp.reserved[slot.slot_id] = slot.epoch
        imp.num_received += 1
        return SlotGrant(block_idx, slot.slot_id, slot.epoch, needs_write=True)

    def confirm(self, import_id: str, grant: SlotGrant) -> None:
        """The KV of `grant`'s block is written and its checksum verified: the slot becomes
        READY, pinned by the import."""
        imp = self._get(import_id)
        epoch = imp.reserved.pop(grant.slot_id, None)
        assert epoch == grant.epoch, f"confirming {grant} of import {import_id!r}: not reserved"
        self.host.confirm_store(grant.slot_id, epoch)
        self.host.pin(self.host.slots[grant.slot_id])
        imp.pinned.append(grant.slot_id)

    def attach(self, import_id: str) -> None:
        """The import's request is queued in the engine under the import's id."""
        imp = self._get(import_id)
        if imp.reserved:
            raise ValueError(f"import {import_id!r} has {len(imp.reserved)} unconfirmed blocks")
        imp.state = ImportState.ATTACHED

    def release(self, import_id: str) -> int:
        """End the import, keeping its confirmed blocks as ordinary (evictable) host cache:
        unpin them, cancel the unconfirmed ones. Idempotent; returns the slots released."""
        imp = self.imports.pop(import_id, None)
        self.last_active.pop(import_id, None)
        if imp is None:
            return 0
        for slot_id, epoch in imp.reserved.items():
            self.host.cancel_store(slot_id, epoch)
        for slot_id in imp.pinned:
            self.host.unpin(slot_id)
        return len(imp.reserved) + len(imp.pinned)

    def cancel(self, import_id: str) -> int:
        """The transfer failed or was aborted: `release`, counted as a cancellation."""
        if import_id in self.imports:
            self.num_cancelled += 1
        return self.release(import_id)

    def reap(self, now: float, idle_timeout_s: float | None,
             live_request_ids: Collection[str] | None) -> int:
        """Cancel the imports nobody will end: attached ones whose request is not live, and
        any idle for longer than `idle_timeout_s`. Returns the slots released."""
        live = None if live_request_ids is None else set(live_request_ids)
        stale = [import_id for import_id, imp in self.imports.items()
                 if (live is not None and imp.state is ImportState.ATTACHED
                     and import_id not in live)
                 or (idle_timeout_s is not None
                     and now - self.last_active[import_id] > idle_timeout_s)]
        return sum(self.cancel(import_id) for import_id in stale)

    def pins(self) -> Counter[int]:
        """Host slot -> pins the imports hold on it."""
        return Counter(slot_id for imp in self.imports.values() for slot_id in imp.pinned)

    def reservations(self) -> dict[int, int]:
        """Host slot -> epoch of every slot an import reserved and has not confirmed."""
        return {sid: e for imp in self.imports.values() for sid, e in imp.reserved.items()}

    def _is_held(self, record: RequestRecord, idx: int) -> bool:
        block_hash, token_bytes = record.block_hashes[idx], record.block_token_bytes[idx]
        if self.pool.get_cached_block(block_hash, token_bytes) is not None:
            return True
        slot = self.host.get(block_hash, token_bytes)
        return slot is not None and slot.state is SlotState.READY

    def _get(self, import_id: str) -> KVImport:
        imp = self.imports.get(import_id)
        if imp is None:
            raise ValueError(f"import {import_id!r} is not open (never opened, or ended)")
        return imp
