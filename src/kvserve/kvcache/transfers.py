"""Copies between the device block pool and the tiers under it, from scheduled to confirmed.

A scheduling pass records these copies: an *offload* when the device pool evicts a cached block
(its KV is copied to a reserved host slot before the step overwrites the block); a *demotion*
when the host tier evicts a READY slot to make room and a disk tier keeps it (host slot -> disk
slot, before the host slot is overwritten); a *load* when a prefix hit continues in the host or
disk tier (a READY slot, pinned, is copied into a freshly allocated device block); and the two
halves of a *swap*: a preempted request's blocks copied out to host slots private to it (an
offload into a SWAPPING slot), and back into fresh device blocks when it resumes (a load).
`take` hands one step's copies to the model; `complete` confirms them after the step ran,
`cancel` undoes them when it did not. Nothing is readable before its copy is confirmed: a stored
slot stays STORING (or SWAPPING), a loaded block stays unpublished.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvserve.kvcache.block import KVBlock
from kvserve.kvcache.errors import CacheCorruption
from kvserve.kvcache.host_tier import HostSlot, HostTier, SlotPool, SlotState
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
class SlotDemotion:
    """Copy host slot `host_slot` (its content before this step) into disk slot `disk_slot`."""

    host_slot: int
    disk_slot: int


@dataclass(frozen=True, slots=True)
class DiskLoad:
    """Copy disk slot `disk_slot` into device block `block_id`."""

    disk_slot: int
    block_id: int


@dataclass(frozen=True, slots=True)
class KVTransfers:
    """One step's copies. The model runs every demotion first (they read host slots that
    offloads overwrite), then every offload (they read blocks this step may overwrite, loads
    included), then every load from either tier, then the forward pass. Empty when there is no
    tier under the device pool."""

    offloads: tuple[BlockOffload, ...] = ()
    loads: tuple[BlockLoad, ...] = ()
    demotions: tuple[SlotDemotion, ...] = ()
    disk_loads: tuple[DiskLoad, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.offloads or self.loads or self.demotions or self.disk_loads)


class LoadSource(enum.Enum):
    """Where a load reads: a prefix hit's READY slot in the host or disk tier (pinned), or a
    swapped-out request's own SWAPPED host slot."""

    HOST = "host"
    DISK = "disk"
    SWAP = "swap"


@dataclass(frozen=True, slots=True)
class PendingLoad:
    """A load not yet confirmed: block `block_idx` of `request_id`'s table (`block_id` at
    `block_epoch`) receives slot `host_slot` at `host_epoch` of the tier `source` names (a
    prefix hit's slot stays pinned until then)."""

    request_id: str
    block_idx: int
    block_id: int
    block_epoch: int
    host_slot: int
    host_epoch: int
    source: LoadSource = LoadSource.HOST


class TransferLedger:
    """Every copy between the tiers from the moment it is scheduled until it is confirmed or
    cancelled: reserved host slots (`stores`: slot -> epoch), reserved disk slots
    (`disk_stores`), private host slots a swap-out copies into (`swap_stores`), and loads
    (`loads`: device block -> load). Single-threaded, like the manager that owns it."""

    def __init__(self, host: HostTier, disk: SlotPool | None = None) -> None:
        self.host = host
        self.disk = disk
        self.stores: dict[int, int] = {}
        self.disk_stores: dict[int, int] = {}
        self.swap_stores: dict[int, int] = {}
        self.loads: dict[int, PendingLoad] = {}
        self._offloads: list[BlockOffload] = []  # scheduled this pass, not yet taken
        self._loads: list[BlockLoad] = []
        self._demotions: list[SlotDemotion] = []
        self._disk_loads: list[DiskLoad] = []
        if disk is not None:
            host.on_evict = self._demote

    @property
    def is_idle(self) -> bool:
        return not (self.stores or self.loads or self.disk_stores or self.swap_stores)

    def tier(self, source: LoadSource) -> SlotPool:
        """The pool a load from `source` reads."""
        if source is LoadSource.DISK:
            assert self.disk is not None, "a disk load without a disk tier"
            return self.disk
        return self.host

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

    def _demote(self, slot: HostSlot) -> None:
        """The host tier is evicting READY `slot` to reuse it this pass: keep its KV in a disk
        slot, unless the disk tier already keeps that block or has no slot to give."""
        assert self.disk is not None and slot.block_hash is not None
        assert slot.token_bytes is not None
        if self.disk.contains(slot.block_hash):
            return
        disk_slot = self.disk.reserve(slot.block_hash, slot.parent_hash, slot.token_bytes,
                                      slot.salt)
        if disk_slot is None:
            return
        self.disk_stores[disk_slot.slot_id] = disk_slot.epoch
        self._demotions.append(SlotDemotion(slot.slot_id, disk_slot.slot_id))

    def swap_out(self, request_id: str, blocks: Sequence[KVBlock]) -> list[tuple[int, int]] | None:
        """Schedule copies of `blocks` (the request's table head) into host slots private to
        the request; returns their (slot id, epoch), in table order. None, changing nothing,
        when the host tier cannot give that many slots."""
        if self.host.num_reservable < len(blocks):
            return None
        out = []
        for block in blocks:
            slot = self.host.reserve_private(request_id)
            assert slot is not None, "reservable slots counted above"
            self.swap_stores[slot.slot_id] = slot.epoch
            self._offloads.append(BlockOffload(block.block_id, slot.slot_id))
            out.append((slot.slot_id, slot.epoch))
        return out

    def release_swap(self, slots: Sequence[tuple[int, int]]) -> None:
        """A swapped-out request's private slots are no longer needed (read back, or the
        request ended): they go free; a copy into one still in flight will not be confirmed."""
        for slot_id, epoch in slots:
            self.swap_stores.pop(slot_id, None)
            self.host.release_private(slot_id, epoch)

    def find_hit(
        self, record: RequestRecord, start: int, stop: int, pending: Mapping[bytes, str],
        tier: SlotPool | None = None,
    ) -> list[HostSlot]:
        """READY slots of `tier` (default: the host tier) for the request's blocks `start`,
        `start + 1`, ... (before `stop`), up to the first miss or a block another live request
        computes or loads now (`pending`). Read-only, except that a refused hash collision is
        counted."""
        pool = self.host if tier is None else tier
        out = []
        for idx in range(start, stop):
            if pending.get(record.block_hashes[idx]) not in (None, record.request_id):
                break
            slot = pool.get(record.block_hashes[idx], record.block_token_bytes[idx])
            if slot is None:
                break
            out.append(slot)
        return out

    def load(self, request_id: str, block_idx: int, block: KVBlock, slot: HostSlot,
             source: LoadSource = LoadSource.HOST) -> None:
        """Schedule a copy of `slot` into `block` (freshly allocated to the request at position
        `block_idx`). A prefix hit's slot was pinned by the caller and is unpinned when the load
        is confirmed or cancelled; a swap's slot is the request's own, SWAPPED."""
        assert block.block_id not in self.loads, f"block {block.block_id} already loading"
        if source is LoadSource.SWAP:
            assert slot.state is SlotState.SWAPPED and slot.owner == request_id, f"swap {slot}"
        else:
            assert slot.state is SlotState.READY and slot.pin_cnt > 0, f"loading from {slot}"
        self.loads[block.block_id] = PendingLoad(request_id, block_idx, block.block_id,
                                                 block.epoch, slot.slot_id, slot.epoch, source)
        if source is LoadSource.DISK:
            self._disk_loads.append(DiskLoad(slot.slot_id, block.block_id))
        else:
            self._loads.append(BlockLoad(slot.slot_id, block.block_id))

    def loads_of(self, request_id: str) -> list[PendingLoad]:
        return [load for load in self.loads.values() if load.request_id == request_id]

    def is_readable(self, load: PendingLoad) -> bool:
        """Whether the slot `load` reads still holds what it held when the load was scheduled."""
        slot = self.tier(load.source).slots[load.host_slot]
        expected = SlotState.SWAPPED if load.source is LoadSource.SWAP else SlotState.READY
        return slot.state is expected and slot.epoch == load.host_epoch

    def check_loads(self, request_id: str) -> CacheCorruption | None:
        """The corruption, if a slot one of the request's loads reads is no longer READY (or
        SWAPPED) at the epoch the load was scheduled for (it must not run then); None when all
        are sound."""
        for load in self.loads_of(request_id):
            if not self.is_readable(load):
                slot = self.tier(load.source).slots[load.host_slot]
                return CacheCorruption(
                    request_id, load.block_id, load.host_epoch, slot.epoch,
                    f"{load.source.value} slot {slot.slot_id} it loads from is "
                    f"{slot.state.value} at epoch {slot.epoch}: reassigned before the load ran")
        return None

    def cancel_request(self, request_id: str) -> None:
        """The request ended before its loads were confirmed: unpin their slots and drop the
        copies not yet handed to the model. Its device blocks were never published."""
        cancelled = [load for load in self.loads.values() if load.request_id == request_id]
        if not cancelled:
            return
        for load in cancelled:
            del self.loads[load.block_id]
            self._unpin(load, confirmed=False)
        gone = {load.block_id for load in cancelled}
        self._loads = [op for op in self._loads if op.block_id not in gone]
        self._disk_loads = [op for op in self._disk_loads if op.block_id not in gone]

    def take(self) -> KVTransfers:
        """The copies scheduled since the last take: the step's `KVTransfers`."""
        out = KVTransfers(tuple(self._offloads), tuple(self._loads), tuple(self._demotions),
                          tuple(self._disk_loads))
        self._offloads, self._loads, self._demotions, self._disk_loads = [], [], [], []
        return out

    def complete(self, transfers: KVTransfers) -> list[PendingLoad]:
        """The step that ran `transfers` finished: stored slots become READY (SWAPPED for a
        swap-out), loaded slots are unpinned. Returns the confirmed loads (whose blocks the
        caller now publishes, and whose swap slots it releases); copies of requests that ended
        meanwhile were cancelled already and are skipped."""
        for demotion in transfers.demotions:
            assert self.disk is not None
            self.disk.confirm_store(demotion.disk_slot, self.disk_stores.pop(demotion.disk_slot))
        for op in transfers.offloads:
            if op.host_slot in self.stores:
                self.host.confirm_store(op.host_slot, self.stores.pop(op.host_slot))
            elif op.host_slot in self.swap_stores:
                self.host.confirm_private(op.host_slot, self.swap_stores.pop(op.host_slot))
        confirmed = []
        for block_id in _loaded_blocks(transfers):
            load = self.loads.pop(block_id, None)
            if load is None:
                continue
            self._unpin(load, confirmed=True)
            confirmed.append(load)
        return confirmed

    def cancel(self, transfers: KVTransfers) -> set[str]:
        """The step that was to run `transfers` failed: stored slots go back free (nothing
        half-copied is readable), loaded slots are unpinned. A swap-out's slots stay SWAPPING,
        for the caller to release (`swap_owners` names them). Returns the requests whose loads
        were cancelled: their KV is incomplete, so the caller must end them."""
        for demotion in transfers.demotions:
            assert self.disk is not None
            self.disk.cancel_store(demotion.disk_slot, self.disk_stores.pop(demotion.disk_slot))
        for op in transfers.offloads:
            if op.host_slot in self.stores:
                self.host.cancel_store(op.host_slot, self.stores.pop(op.host_slot))
        failed = set()
        for block_id in _loaded_blocks(transfers):
            load = self.loads.pop(block_id, None)
            if load is not None:
                self._unpin(load, confirmed=False)
                failed.add(load.request_id)
        return failed

    def swap_owners(self, transfers: KVTransfers) -> set[str]:
        """The requests whose swap-out copies `transfers` carries (still unconfirmed)."""
        return {owner for op in transfers.offloads if op.host_slot in self.swap_stores
                and (owner := self.host.slots[op.host_slot].owner) is not None}

    def _unpin(self, load: PendingLoad, *, confirmed: bool) -> None:
        pool = self.tier(load.source)
        if load.source is not LoadSource.SWAP:
            pool.unpin(load.host_slot)
        if not confirmed:
            pool.counters.cancelled_loads += 1
        elif load.source is LoadSource.SWAP:
            pool.counters.swapped_in_blocks += 1
        else:
            pool.counters.loads += 1


def _loaded_blocks(transfers: KVTransfers) -> list[int]:
    """The device blocks the step's loads (from either tier) write."""
    return [op.block_id for op in transfers.loads] + [op.block_id for op in transfers.disk_loads]
