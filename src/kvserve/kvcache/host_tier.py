"""The host tier: a bounded pool of host-memory KV slots under the device block pool.

Pure bookkeeping, like the block pool: it decides which slot holds which block's KV, never
touches a tensor. A slot is FREE, STORING (a device->host copy is scheduled but not yet
confirmed: never readable) or READY (readable, in an LRU keyed by block hash). A READY slot
may be pinned by in-flight loads; a pinned slot is never evicted. free + storing + ready = the
number of slots, always.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, replace


class SlotState(enum.Enum):
    """Where a host slot is in its life: FREE -> STORING -> READY -> (evicted) STORING ..."""

    FREE = "free"
    STORING = "storing"  # a copy into it is scheduled; its content is not readable yet
    READY = "ready"  # holds a block's KV; hit-able through the LRU


class HostSlot:
    """Metadata of one host slot of `block_size` token positions.

    The content key (`block_hash`, `parent_hash`, `token_bytes`, `salt`) is set when the slot is
    reserved for a store and kept while it is READY, so a hit re-checks the tokens exactly as a
    device hit does. `epoch` changes whenever the slot is given new content; `pin_cnt` counts the
    in-flight loads reading it.
    """

    __slots__ = (
        "block_hash",
        "epoch",
        "parent_hash",
        "pin_cnt",
        "salt",
        "slot_id",
        "state",
        "token_bytes",
    )

    def __init__(self, slot_id: int) -> None:
        self.slot_id = slot_id
        self.state = SlotState.FREE
        self.epoch = 0
        self.pin_cnt = 0
        self.block_hash: bytes | None = None
        self.parent_hash: bytes | None = None
        self.token_bytes: bytes | None = None
        self.salt: str | None = None

    def clear_content(self) -> None:
        self.block_hash = self.parent_hash = self.token_bytes = self.salt = None

    def __repr__(self) -> str:
        key = self.block_hash.hex()[:8] if self.block_hash else None
        return (f"HostSlot(id={self.slot_id}, {self.state.value}, epoch={self.epoch}, "
                f"pins={self.pin_cnt}, hash={key})")


@dataclass(slots=True)
class HostTierCounters:
    """Monotonic counters of the host tier (never reset while serving)."""

    hit_blocks: int = 0  # blocks a prefix hit took from the host tier (loads scheduled)
    hit_tokens: int = 0  # the prompt tokens those blocks cover
    stores: int = 0  # device->host copies confirmed (the block became READY)
    loads: int = 0  # host->device copies confirmed
    evictions: int = 0  # READY slots dropped to make room for newly evicted device blocks
    dropped_stores: int = 0  # device evictions not kept: every slot was storing or pinned
    cancelled_stores: int = 0  # stores whose step never ran or failed: the slot went back free
    cancelled_loads: int = 0  # loads whose request ended or whose step failed before confirming
    hash_collisions: int = 0  # host hash matched but the tokens did not: the hit was refused


@dataclass(frozen=True, slots=True)
class HostTierStats:
    """A point-in-time view of the host tier: its census plus its counters."""

    num_slots: int
    num_free_slots: int
    num_storing_slots: int
    num_ready_slots: int
    num_pinned_slots: int
    counters: HostTierCounters

    @property
    def usage(self) -> float:
        """Fraction of slots holding or receiving KV."""
        used = self.num_storing_slots + self.num_ready_slots
        return used / self.num_slots if self.num_slots else 0.0


class HostTier:
    """`num_slots` host slots, reused forever; LRU eviction among unpinned READY slots.

    Contract: only READY slots are in `lru` and only they can be found by `get`; a STORING slot
    becomes READY only through `confirm_store`; a pinned slot is never evicted or cancelled; the
    tier holds at most one slot per block hash.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.slots = [HostSlot(slot_id) for slot_id in range(num_slots)]
        self.free_ids: deque[int] = deque(range(num_slots))
        self.lru: OrderedDict[bytes, HostSlot] = OrderedDict()  # READY, least recent first
        self.storing: dict[bytes, HostSlot] = {}
        self.num_pins = 0  # sum of every slot's pin_cnt: what the O(1) idle check reads
        self.counters = HostTierCounters()

    def contains(self, block_hash: bytes) -> bool:
        """Whether the tier holds or is receiving this block (READY or STORING)."""
        return block_hash in self.lru or block_hash in self.storing

    def get(self, block_hash: bytes, token_bytes: bytes) -> HostSlot | None:
        """The READY slot caching exactly these tokens under this hash, or None. Read-only,
        except that a refused match (same hash, other tokens: a collision) is counted."""
        slot = self.lru.get(block_hash)
        if slot is None:
            return None
        if slot.token_bytes != token_bytes:
            self.counters.hash_collisions += 1
            return None
        return slot

    def is_fresh(
        self, slots: Sequence[HostSlot], epochs: Sequence[int], hashes: Sequence[bytes]
    ) -> bool:
        """Whether `slots` are still READY at `epochs`, holding the blocks `hashes` names."""
        return len(slots) == len(epochs) <= len(hashes) and all(
            s.state is SlotState.READY and s.epoch == e and s.block_hash == h
            for s, e, h in zip(slots, epochs, hashes, strict=False)
        )

    def reserve(
        self, block_hash: bytes, parent_hash: bytes | None, token_bytes: bytes, salt: str | None
    ) -> HostSlot | None:
        """A STORING slot (new epoch) for a block about to be copied in: a free slot, else the
        least recently used unpinned READY slot (evicted). None, changing nothing, if every
        slot is storing or pinned."""
        assert not self.contains(block_hash), f"block {block_hash.hex()[:8]} is already kept"
        if self.free_ids:
            slot = self.slots[self.free_ids.popleft()]
        else:
            victim = self._victim()
            if victim is None:
                self.counters.dropped_stores += 1
                return None
            assert victim.block_hash is not None
            del self.lru[victim.block_hash]
            victim.clear_content()
            self.counters.evictions += 1
            slot = victim
        slot.state = SlotState.STORING
        slot.epoch += 1
        slot.block_hash, slot.parent_hash = block_hash, parent_hash
        slot.token_bytes, slot.salt = token_bytes, salt
        self.storing[block_hash] = slot
        return slot

    def confirm_store(self, slot_id: int, epoch: int) -> None:
        """The copy into `slot_id` completed: the slot becomes READY (most recently used)."""
        slot = self.slots[slot_id]
        assert slot.state is SlotState.STORING and slot.epoch == epoch, f"confirming {slot}"
        assert slot.block_hash is not None
        del self.storing[slot.block_hash]
        slot.state = SlotState.READY
        self.lru[slot.block_hash] = slot
        self.counters.stores += 1

    def cancel_store(self, slot_id: int, epoch: int) -> None:
        """The copy into `slot_id` never ran (or failed): the slot goes back free, unreadable."""
        slot = self.slots[slot_id]
        assert slot.state is SlotState.STORING and slot.epoch == epoch, f"cancelling {slot}"
        assert slot.block_hash is not None
        del self.storing[slot.block_hash]
        self._free(slot)
        self.counters.cancelled_stores += 1

    def pin(self, slot: HostSlot) -> None:
        """A load will read `slot`: keep it until `unpin`, and mark it most recently used."""
        assert slot.state is SlotState.READY and slot.block_hash is not None, f"pinning {slot}"
        slot.pin_cnt += 1
        self.num_pins += 1
        self.lru.move_to_end(slot.block_hash)

    def unpin(self, slot_id: int) -> None:
        slot = self.slots[slot_id]
        assert slot.pin_cnt > 0, f"unpinning {slot}"
        slot.pin_cnt -= 1
        self.num_pins -= 1

    def clear(self) -> bool:
        """Forget every READY slot. Refused (False) while a slot is storing or pinned."""
        if self.storing or any(s.pin_cnt for s in self.lru.values()):
            return False
        for slot in self.lru.values():
            self._free(slot)
        self.lru.clear()
        return True

    def stats(self) -> HostTierStats:
        return HostTierStats(
            num_slots=self.num_slots,
            num_free_slots=len(self.free_ids),
            num_storing_slots=len(self.storing),
            num_ready_slots=len(self.lru),
            num_pinned_slots=sum(1 for s in self.lru.values() if s.pin_cnt),
            counters=replace(self.counters),
        )

    def lru_slot_ids(self) -> list[int]:
        """READY slot ids, least recently used first; for tests and debugging."""
        return [slot.slot_id for slot in self.lru.values()]

    def _victim(self) -> HostSlot | None:
        """The least recently used READY slot no load reads, or None."""
        return next((s for s in self.lru.values() if s.pin_cnt == 0), None)

    def _free(self, slot: HostSlot) -> None:
        slot.clear_content()
        slot.state = SlotState.FREE
        self.free_ids.append(slot.slot_id)
