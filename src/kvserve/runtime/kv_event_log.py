"""A worker's KV events for routers: bounded, numbered, read by polling.

The engine drains its cache's events after every step into a `KVEventLog` (without it they
would pile up in the cache for the life of the process). Routers poll `since(after)`: every event
numbered above `after`, oldest first. The log keeps the newest `capacity` events; a reader that
fell further behind gets `gap=True` and must forget what it knew of this worker (its index then
refills from new events). Events are JSON-ready dicts:

- {"seq": n, "type": "stored", "block_hashes": [hex, ...], "parent_block_hash": hex | null}
- {"seq": n, "type": "removed", "block_hashes": [hex, ...]}
- {"seq": n, "type": "cleared"}

`seq` starts at 1 and increases by one per event; it restarts with the process, which a reader
sees as `next_seq` below its cursor (treat it as a gap).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

DEFAULT_CAPACITY = 65_536


@dataclass(frozen=True, slots=True)
class EventPage:
    events: list[dict[str, Any]]
    next_seq: int  # the cursor to pass as `after` next time
    gap: bool  # events between `after` and the first one here were dropped

    def as_dict(self) -> dict[str, Any]:
        return {"events": self.events, "next_seq": self.next_seq, "gap": self.gap}


def event_dict(event: KVEvent) -> dict[str, Any]:
    """The JSON form of one event (without its `seq`)."""
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        out = {"type": "stored", "block_hashes": [h.hex() for h in event.block_hashes],
               "parent_block_hash": parent.hex() if parent is not None else None}
        if event.adapter_digest is not None:
            out["adapter_digest"] = event.adapter_digest.hex()
        return out
    if isinstance(event, BlockRemoved):
        return {"type": "removed", "block_hashes": [h.hex() for h in event.block_hashes]}
    if isinstance(event, AllBlocksCleared):
        return {"type": "cleared"}
    raise TypeError(f"not a KV event: {event!r}")


class KVEventLog:
    """Thread-safe: the engine thread appends, request handlers read."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._events: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._last_seq = 0
        self._lock = threading.Lock()
        self._listener: Callable[[], None] | None = None
        self._publisher: Callable[[Sequence[KVEvent]], None] | None = None

    def set_publisher(self, publisher: Callable[[Sequence[KVEvent]], None] | None) -> None:
        """Also hand each non-empty `extend`'s events, as given, to `publisher` (from the
        appending thread): how a worker publishes them on vLLM's wire, one batch a step."""
        self._publisher = publisher

    def set_listener(self, listener: Callable[[], None] | None) -> None:
        """Call `listener()` (from the appending thread, after the append) whenever events
        arrive: how a server wakes readers that wait for new events."""
        self._listener = listener

    @property
    def last_seq(self) -> int:
        return self._last_seq

    def extend(self, events: Iterable[KVEvent]) -> None:
        given = list(events)
        converted = [event_dict(e) for e in given]
        if not converted:
            return
        if self._publisher is not None:
            self._publisher(given)
        with self._lock:
            for item in converted:
                self._last_seq += 1
                item["seq"] = self._last_seq
                self._events.append(item)
        if self._listener is not None:
            self._listener()

    def since(self, after: int, limit: int = 4096) -> EventPage:
        """At most `limit` events numbered above `after`, oldest first."""
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        with self._lock:
            if after > self._last_seq:  # the reader's cursor is from an earlier process
                return EventPage([], self._last_seq, gap=True)
            oldest = self._events[0]["seq"] if self._events else self._last_seq + 1
            gap = after + 1 < oldest
            start = max(0, after + 1 - oldest)
            page = list(itertools.islice(self._events, start, start + limit))
            next_seq = page[-1]["seq"] if page else max(after, oldest - 1)
        return EventPage(page, next_seq, gap)
