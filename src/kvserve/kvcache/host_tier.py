"""A tier under the device block pool: a bounded pool of KV slots (host memory, or a file).

The host tier and the disk tier below it are both a `SlotPool` (`HostTier` is its old name).
Pure bookkeeping, like the block pool: it decides which slot holds which block's KV, never
touches a tensor. A slot is FREE, STORING (a copy into it is scheduled but not yet confirmed:
never readable) or READY (readable, in an LRU keyed by block hash). A READY slot may be pinned
by in-flight loads; a pinned slot is never evicted. A slot may also be private to one request
that was preempted by swapping (SWAPPING while its copy runs, then SWAPPED): never hit-able by
another request, never evicted. free + storing + ready + private = the number of slots, always.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace


class SlotState(enum.Enum):
    """Where a slot is in its life: FREE -> STORING -> READY -> (evicted) STORING ..., or, for
    a swapped-out request, FREE -> SWAPPING -> SWAPPED -> FREE."""

    FREE = "free"
    STORING = "storing"  # a copy into it is scheduled; its content is not readable yet
    READY = "ready"  # holds a block's KV; hit-able through the LRU
    SWAPPING = "swapping"  # a swapped-out request's block is being copied in; unreadable
    SWAPPED = "swapped"  # holds a swapped-out request's block; only that request reads it


class HostSlot:
    """Metadata of one slot of `block_size` token positions (in the host or the disk tier).

    The content key (`block_hash`, `parent_hash`, `token_bytes`, `salt`) is set when the slot is
    reserved for a store and kept while it is READY, so a hit re-checks the tokens exactly as a
    device hit does. `epoch` changes whenever the slot is given new content; `pin_cnt` counts the
    in-flight loads reading it; `owner` is the swapped-out request a private slot belongs to.
    """

    __slots__ = (
        "block_hash",
        "epoch",
        "owner",
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
        self.owner: str | None = None

    def clear_content(self) -> None:
        self.block_hash = self.parent_hash = self.token_bytes = self.salt = self.owner = None

    def __repr__(self) -> str:
        key = self.block_hash.hex()[:8] if self.block_hash else None
        return (f"HostSlot(id={self.slot_id}, {self.state.value}, epoch={self.epoch}, "
                f"pins={self.pin_cnt}, hash={key})")


@dataclass(slots=True)
class HostTierCounters:
    """Monotonic counters of one tier (host or disk; never reset while serving)."""

    hit_blocks: int = 0  # blocks a prefix hit took from this tier (loads scheduled)
    hit_tokens: int = 0  # the prompt tokens those blocks cover
    stores: int = 0  # copies into this tier confirmed (the block became READY)
    loads: int = 0  # copies from this tier to the device confirmed
    evictions: int = 0  # READY slots given up to make room (to the tier below, if any)
    dropped_stores: int = 0  # evictions from above not kept: every slot was busy
    cancelled_stores: int = 0  # stores whose step never ran or failed: the slot went back free
    cancelled_loads: int = 0  # loads whose request ended or whose step failed before confirming
    hash_collisions: int = 0  # hash matched but the tokens did not: the hit was refused
    swapped_out_blocks: int = 0  # blocks of swapped-out requests copied in (confirmed)
    swapped_in_blocks: int = 0  # of those, copied back to the device (confirmed)


@dataclass(frozen=True, slots=True)
class HostTierStats:
    """A point-in-time view of one tier: its census plus its counters."""

    num_slots: int
    num_free_slots: int
    num_storing_slots: int
    num_ready_slots: int
    num_pinned_slots: int
    counters: HostTierCounters
    num_swapped_slots: int = 0  # private to swapped-out requests (SWAPPING or SWAPPED)

    @property
    def usage(self) -> float:
        """Fraction of slots holding or receiving KV."""
        used = self.num_storing_slots + self.num_ready_slots + self.num_swapped_slots
        return used / self.num_slots if self.num_slots else 0.0


class SlotPool:
    """`num_slots` slots of one tier, reused forever; LRU eviction among unpinned READY slots.

    Contract: only READY slots are in `lru` and only they can be found by `get`; a STORING slot
    becomes READY only through `confirm_store`; a pinned or private slot is never evicted or
    cancelled; the tier holds at most one READY or STORING slot per block hash. `on_evict`, if
    set, sees each evicted READY slot with its content still set, before it is reused (the
    host tier demotes it to the disk tier there).
    """

    def __init__(self, num_slots: int, name: str = "host") -> None:
        if num_slots < 1:
            raise ValueError(f"a {name} tier needs at least one slot, got {num_slots}")
        self.name = name
        self.num_slots = num_slots
        self.slots = [HostSlot(slot_id) for slot_id in range(num_slots)]
        self.free_ids: deque[int] = deque(range(num_slots))
        self.lru: OrderedDict[bytes, HostSlot] = OrderedDict()  # READY, least recent first
        self.storing: dict[bytes, HostSlot] = {}
        self.num_pins = 0  # sum of every slot's pin_cnt: what the O(1) idle check reads
        self.private: dict[int, HostSlot] = {}  # SWAPPING or SWAPPED, by slot id
        self.counters = HostTierCounters()
        self.on_evict: Callable[[HostSlot], None] | None = None

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
        self, block_hash: bytes, parent_hash: bytes | None, token_bytes: bytes, salt: str | None,
        *, demote: bool = True,
    ) -> HostSlot | None:
        """A STORING slot (new epoch) for a block about to be copied in: a free slot, else the
        least recently used unpinned READY slot (evicted; handed to `on_evict` only when
        `demote`). None, changing nothing, if every slot is storing or pinned. A caller that
        writes the slot before the next step runs its copies (an import) must pass
        demote=False: a demotion copy scheduled for that step would read the new content."""
        assert not self.contains(block_hash), f"block {block_hash.hex()[:8]} is already kept"
        slot = self._take_slot(demote)
        if slot is None:
            self.counters.dropped_stores += 1
            return None
        slot.state = SlotState.STORING
        slot.block_hash, slot.parent_hash = block_hash, parent_hash
        slot.token_bytes, slot.salt = token_bytes, salt
        self.storing[block_hash] = slot
        return slot

    @property
    def num_reservable(self) -> int:
        """Slots a reservation could take now: free ones plus unpinned READY ones."""
        return len(self.free_ids) + sum(1 for s in self.lru.values() if s.pin_cnt == 0)

    def reserve_private(self, owner: str) -> HostSlot | None:
        """A SWAPPING slot (new epoch) for one block of swapped-out request `owner`, taken like
        `reserve` takes one; None, changing nothing, if every slot is busy."""
        slot = self._take_slot()
        if slot is None:
            return None
        slot.state = SlotState.SWAPPING
        slot.owner = owner
        self.private[slot.slot_id] = slot
        return slot

    def confirm_private(self, slot_id: int, epoch: int) -> None:
        """The copy into private `slot_id` completed: its owner may read it back."""
        slot = self.slots[slot_id]
        assert slot.state is SlotState.SWAPPING and slot.epoch == epoch, f"confirming {slot}"
        slot.state = SlotState.SWAPPED
        self.counters.swapped_out_blocks += 1

    def release_private(self, slot_id: int, epoch: int) -> None:
        """Its owner is done with private `slot_id` (read back, or ended): the slot goes free."""
        slot = self.slots[slot_id]
        assert slot.slot_id in self.private and slot.epoch == epoch, f"releasing {slot}"
        del self.private[slot_id]
        self._free(slot)

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
        """Forget every READY slot. Refused (False) while a slot is storing, pinned or private."""
        if self.storing or self.private or any(s.pin_cnt for s in self.lru.values()):
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
            num_swapped_slots=len(self.private),
        )

    def lru_slot_ids(self) -> list[int]:
        """READY slot ids, least recently used first; for tests and debugging."""
        return [slot.slot_id for slot in self.lru.values()]

    def _take_slot(self, demote: bool = True) -> HostSlot | None:
        """A free slot, else the least recently used unpinned READY one (evicted, handed to
        `on_evict` first), with a new epoch; None, changing nothing, when every slot is busy."""
        if self.free_ids:
            slot = self.slots[self.free_ids.popleft()]
        else:
            victim = self._victim()
            if victim is None:
                return None
            assert victim.block_hash is not None
            if self.on_evict is not None and demote:
                self.on_evict(victim)
            del self.lru[victim.block_hash]
            victim.clear_content()
            self.counters.evictions += 1
            slot = victim
        slot.epoch += 1
        return slot

    def _victim(self) -> HostSlot | None:
        """The least recently used READY slot no load reads, or None."""
        return next((s for s in self.lru.values() if s.pin_cnt == 0), None)

    def _free(self, slot: HostSlot) -> None:
        slot.clear_content()
        slot.state = SlotState.FREE
        self.free_ids.append(slot.slot_id)


HostTier = SlotPool  # the name the host tier had before the disk tier shared the class
