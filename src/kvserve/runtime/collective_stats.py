"""CollectiveStats: what every collective on the serving path cost, and how the ranks kept pace.

Plain counters, written by the engine thread and read by the metrics scrape (under one lock, so
a scrape sees a consistent snapshot). Durations are bucketed like a Prometheus histogram, by
(op, backend); errors are counted by (op, kind); rank skew is, per step, the spread of the
ranks' compute times (wall time minus time inside collectives): what the fastest rank waited
for the slowest.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from enum import Enum

DURATION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class CollectiveErrorKind(Enum):
    """Why a collective failed: it did not finish in time, a rank is gone, or the backend
    reported another error."""

    TIMEOUT = "timeout"
    RANK_LOST = "rank_lost"
    BACKEND_ERROR = "backend_error"


@dataclass(slots=True)
class Histogram:
    """Non-cumulative counts per bucket of DURATION_BUCKETS (the last slot is +Inf)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(DURATION_BUCKETS) + 1))
    total: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        idx = next((i for i, b in enumerate(DURATION_BUCKETS) if seconds <= b),
                   len(DURATION_BUCKETS))
        self.counts[idx] += 1
        self.total += seconds
        self.count += 1

    def copy(self) -> Histogram:
        return Histogram(list(self.counts), self.total, self.count)


@dataclass(frozen=True, slots=True)
class CollectiveSnapshot:
    """A consistent copy for one scrape."""

    durations: dict[tuple[str, str], Histogram]  # (op, backend) -> seconds
    errors: dict[tuple[str, str], int]  # (op, kind) -> count
    rank_skew: Histogram
    last_rank_skew_s: float
    slowest_rank: int
    num_divergences: int
    world_size: int


class CollectiveStats:
    """The tensor-parallel group's counters, seen from rank 0 (the worker that serves HTTP)."""

    def __init__(self, world_size: int) -> None:
        self._lock = threading.Lock()
        self._durations: dict[tuple[str, str], Histogram] = {}
        self._errors: dict[tuple[str, str], int] = {}
        self._skew = Histogram()
        self._last_skew = 0.0
        self._slowest = 0
        self._divergences = 0
        self.world_size = world_size

    def observe(self, op: str, backend: str, seconds: float) -> None:
        with self._lock:
            self._durations.setdefault((op, backend), Histogram()).observe(seconds)

    def error(self, op: str, kind: CollectiveErrorKind) -> None:
        with self._lock:
            key = (op, kind.value)
            self._errors[key] = self._errors.get(key, 0) + 1

    def divergence(self) -> None:
        with self._lock:
            self._divergences += 1

    def observe_compute(self, compute_s: list[float]) -> None:
        """One step's compute seconds per rank (index = rank)."""
        skew = max(compute_s) - min(compute_s)
        with self._lock:
            self._skew.observe(skew)
            self._last_skew = skew
            self._slowest = max(range(len(compute_s)), key=compute_s.__getitem__)

    def snapshot(self) -> CollectiveSnapshot:
        with self._lock:
            return CollectiveSnapshot({k: h.copy() for k, h in self._durations.items()},
                                      dict(self._errors), self._skew.copy(), self._last_skew,
                                      self._slowest, self._divergences, self.world_size)
