"""Copies between the device block pool and the host tier, from scheduled to confirmed.

A scheduling pass records two kinds of copy: an *offload* when the device pool evicts a cached
block (its KV is copied to a reserved host slot before the step overwrites the block), and a
*load* when a prefix hit continues in the host tier (a READY slot, pinned, is copied into a
freshly allocated device block). `take` hands one step's copies to the model; `complete` confirms
them after the step ran, `cancel` undoes them when it did not. Nothing is readable before its
copy is confirmed: a stored slot stays STORING, a loaded block stays unpublished.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvserve.kvcache.block import KVBlock
from kvserve.kvcache.errors import CacheCorruption
from kvserve.kvcache.host_tier import HostSlot, HostTier, SlotState
from kvserve.kvcache.ledger import RequestRecord


@dataclass(frozen=True, slots=True)
class BlockOffload:
    """Copy device block `block_id` (its content before this step) into host slot `host_slot`."""

    block_id: int
    host_slot: int


@dataclass(frozen=True, slots=True)
class BlockLoad:
    """Copy host slot `host_slot` into device block `block_id`."""

    host_slot: int
    block_id: int


@dataclass(frozen=True, slots=True)
class KVTransfers:
    """One step's copies. The model runs every offload first (they read blocks this step may
    overwrite, loads included), then every load, then the forward pass. Empty when the host tier
    is off."""

    offloads: tuple[BlockOffload, ...] = ()
    loads: tuple[BlockLoad, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.offloads or self.loads)


@dataclass(frozen=True, slots=True)
class PendingLoad:
    """A load not yet confirmed: block `block_idx` of `request_id`'s table (`block_id` at
    `block_epoch`) receives host slot `host_slot` at `host_epoch`, which stays pinned."""

    request_id: str
    block_idx: int
    block_id: int
    block_epoch: int
    host_slot: int
    host_epoch: int


class TransferLedger:
    """Every copy between the tiers from the moment it is scheduled until it is confirmed or
    cancelled: reserved host slots (`stores`: slot -> epoch) and pinned loads (`loads`: device
    block -> load). Single-threaded, like the manager that owns it."""

    def __init__(self, host: HostTier) -> None:
        self.host = host
        self.stores: dict[int, int] = {}
        self.loads: dict[int, PendingLoad] = {}
        self._offloads: list[BlockOffload] = []  # scheduled this pass, not yet taken
        self._loads: list[BlockLoad] = []

    @property
    def is_idle(self) -> bool:
        return not self.stores and not self.loads

    def offload(self, block: KVBlock) -> None:
        """The device pool is evicting cached `block` to reuse it this pass: keep its KV in a
        host slot, unless the tier already keeps that block or has no slot to give."""
        assert block.block_hash is not None and block.token_bytes is not None
        if self.host.contains(block.block_hash):
            return
        slot = self.host.reserve(block.block_hash, block.parent_hash, block.token_bytes,
                                 block.salt)
        if slot is None:
            return
        self.stores[slot.slot_id] = slot.epoch
        self._offloads.append(BlockOffload(block.block_id, slot.slot_id))

    def find_hit(
        self, record: RequestRecord, start: int, stop: int, pending: Mapping[bytes, str]
    ) -> list[HostSlot]:
        """READY slots for the request's blocks `start`, `start + 1`, ... (before `stop`), up
        to the first miss or a block another live request computes or loads now (`pending`).
        Read-only, except that a refused hash collision is counted."""
        out = []
        for idx in range(start, stop):
            if pending.get(record.block_hashes[idx]) not in (None, record.request_id):
                break
            slot = self.host.get(record.block_hashes[idx], record.block_token_bytes[idx])
            if slot is None:
                break
            out.append(slot)
        return out

    def load(self, request_id: str, block_idx: int, block: KVBlock, slot: HostSlot) -> None:
        """Schedule a copy of `slot`, which the caller pinned, into `block` (freshly allocated
        to the request at position `block_idx`); the pin is released when the load is
        confirmed or cancelled."""
        assert block.block_id not in self.loads, f"block {block.block_id} already loading"
        assert slot.state is SlotState.READY and slot.pin_cnt > 0, f"loading from {slot}"
        self.loads[block.block_id] = PendingLoad(request_id, block_idx, block.block_id,
                                                 block.epoch, slot.slot_id, slot.epoch)
        self._loads.append(BlockLoad(slot.slot_id, block.block_id))

    def loads_of(self, request_id: str) -> list[PendingLoad]:
        return [load for load in self.loads.values() if load.request_id == request_id]

    def check_loads(self, request_id: str) -> CacheCorruption | None:
        """The corruption, if a slot one of the request's loads reads is no longer READY at the
        epoch the load was scheduled for (it must not run then); None when all are sound."""
        for load in self.loads_of(request_id):
            slot = self.host.slots[load.host_slot]
            if slot.state is not SlotState.READY or slot.epoch != load.host_epoch:
                return CacheCorruption(
                    request_id, load.block_id, load.host_epoch, slot.epoch,
                    f"host slot {slot.slot_id} it loads from is {slot.state.value} at epoch "
                    f"{slot.epoch}: reassigned before the load ran")
        return None

    def cancel_request(self, request_id: str) -> None:
        """The request ended before its loads were confirmed: unpin their slots and drop the
        copies not yet handed to the model. Its device blocks were never published."""
        cancelled = {load.block_id for load in self.loads_of(request_id)}
        if not cancelled:
            return
        for block_id in cancelled:
            self.host.unpin(self.loads.pop(block_id).host_slot)
        self.host.counters.cancelled_loads += len(cancelled)
        self._loads = [op for op in self._loads if op.block_id not in cancelled]

    def take(self) -> KVTransfers:
        """The copies scheduled since the last take: the step's `KVTransfers`."""
        out = KVTransfers(tuple(self._offloads), tuple(self._loads))
        self._offloads, self._loads = [], []
        return out

    def complete(self, transfers: KVTransfers) -> list[PendingLoad]:
        """The step that ran `transfers` finished: stored slots become READY, loaded slots are
        unpinned. Returns the confirmed loads (whose blocks the caller now publishes); loads of
        requests that ended meanwhile were cancelled already and are skipped."""
        for op in transfers.offloads:
            self.host.confirm_store(op.host_slot, self.stores.pop(op.host_slot))
        confirmed = []
        for load_op in transfers.loads:
            load = self.loads.pop(load_op.block_id, None)
            if load is None:
                continue
            self.host.unpin(load.host_slot)
            self.host.counters.loads += 1
            confirmed.append(load)
        return confirmed

    def cancel(self, transfers: KVTransfers) -> set[str]:
        """The step that was to run `transfers` failed: stored slots go back free (nothing
        half-copied is readable), loaded slots are unpinned. Returns the requests whose loads
        were cancelled: their KV is incomplete, so the caller must end them."""
        for op in transfers.offloads:
            self.host.cancel_store(op.host_slot, self.stores.pop(op.host_slot))
        failed = set()
        for load_op in transfers.loads:
            load = self.loads.pop(load_op.block_id, None)
            if load is not None:
                self.host.unpin(load.host_slot)
                self.host.counters.cancelled_loads += 1
                failed.add(load.request_id)
        return failed
