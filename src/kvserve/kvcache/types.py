"""Small value types shared by the cache's modules and its callers."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FreeReason(enum.Enum):
    """Why a request's blocks were released. Every path goes through the one `free`."""

    FINISHED = "finished"
    ABORTED = "aborted"
    TIMEOUT = "timeout"
    PREEMPTED = "preempted"
    DISCONNECTED = "disconnected"
    ERROR = "error"
    REAPED = "reaped"


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The cached head of a request's prompt, as found by a read-only lookup.

    `block_ids` and `epochs` pair up; the allocation that consumes the hit re-checks the epochs,
    so a hit that went stale in between is refused rather than read. `host_slots` and
    `host_epochs` pair up the same way: the hit's continuation in the host tier, the blocks right
    after `block_ids` (copied into fresh device blocks by the step that allocates them);
    `disk_slots` and `disk_epochs` the same in the disk tier. `from_disk` says, for each block
    after `block_ids` in order, whether it comes from the disk (empty: all from the host).
    `num_tokens` covers every tier. `num_pending_tokens`: how many tokens right after the hit
    another live request is computing (or loading) now; a scheduler that waits for them gets
    them from the cache instead of computing them twice.

    `num_in_flight_tokens`: only from a lookup given `in_flight` requests. The last
    `num_in_flight_tokens // block_size` of `block_ids` are blocks those requests write in the
    step being planned (not yet published); `in_flight_owners` names them. Such a hit is good
    for that step only (see `KVCacheManager.lookup`).
    """

    block_ids: tuple[int, ...] = ()
    epochs: tuple[int, ...] = ()
    num_tokens: int = 0
    num_pending_tokens: int = 0
    host_slots: tuple[int, ...] = ()
    host_epochs: tuple[int, ...] = ()
    disk_slots: tuple[int, ...] = ()
    disk_epochs: tuple[int, ...] = ()
    from_disk: tuple[bool, ...] = ()
    num_in_flight_tokens: int = 0
    in_flight_owners: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SlotAllocation:
    """What `allocate_slots` did: the blocks newly added to the request's table."""

    new_block_ids: tuple[int, ...]
    num_cached_tokens: int  # tokens of this request served from the prefix cache
