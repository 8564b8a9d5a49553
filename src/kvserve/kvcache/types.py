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
    so a hit that went stale in between is refused rather than read. `num_pending_tokens`: how
    many tokens right after the hit another live request is computing now; a scheduler that
    waits for them gets them from the cache instead of computing them twice.
    """

    block_ids: tuple[int, ...] = ()
    epochs: tuple[int, ...] = ()
    num_tokens: int = 0
    num_pending_tokens: int = 0


@dataclass(frozen=True, slots=True)
class SlotAllocation:
    """What `allocate_slots` did: the blocks newly added to the request's table."""

    new_block_ids: tuple[int, ...]
    num_cached_tokens: int  # tokens of this request served from the prefix cache
