"""The simulated clock: a heap of timed callbacks, run in (time, priority, insertion) order."""

from __future__ import annotations

import enum
import heapq
from collections.abc import Callable

Action = Callable[[float], None]
"""An event's effect; it receives the simulated time at which it fires."""


class Priority(enum.IntEnum):
    """Order of events due at the same instant. A step that ends at t is applied before anything
    else at t, so with instantaneous compute every request is served before the next one
    arrives (what the offline replay assumes); scrapes see the state after the step."""

    STEP_END = 0
    SCRAPE = 1
    CLIENT = 2


class EventQueue:
    """A min-heap of (time, priority, sequence number, action). Deterministic: events due at
    the same time and priority run in insertion order. Never runs an event in the past."""

    __slots__ = ("_heap", "_next", "now", "num_events")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Action]] = []
        self._next = 0
        self.now = 0.0
        self.num_events = 0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, time: float, priority: Priority, action: Action) -> None:
        """Run `action(time)` at `time` (>= now)."""
        assert time >= self.now, f"event at {time} is before the clock ({self.now})"
        heapq.heappush(self._heap, (time, int(priority), self._next, action))
        self._next += 1

    def run_next(self) -> bool:
        """Advance the clock to the next event and run it; False when none is left."""
        if not self._heap:
            return False
        time, _, _, action = heapq.heappop(self._heap)
        self.now = time
        self.num_events += 1
        action(time)
        return True
