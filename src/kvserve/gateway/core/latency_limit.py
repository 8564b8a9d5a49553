"""An adaptive limit on requests in flight, from whether they start answering in time.

Batch slots bound what a kvserve worker runs at once, but not how long a request waits for its
first token: a worker that takes more than it can answer in time (vLLM's CPU server accepts
everything; long prompts make every prefill slow) lets the clients time out and resend. So the
gateway also keeps an AIMD limit, as TCP keeps its congestion window:

- a late first byte (the workers took longer than LATE_FRACTION of the time its client had
  left when it went upstream; the wait for admission does not count, since this limit sets
  it) or a client that left before its first byte is a loss: the limit falls to `decrease`
  times what was in flight, at most once per generation (requests admitted before the last
  cut were sent under the old limit and say nothing about the new one);
- a first byte in time while the limit is in use (at least half of it in flight) adds one
  request per limit's worth of such answers, one a round trip.

Pure and synchronous (no clock of its own): the admission queue owns it.
"""

from __future__ import annotations

# A first byte later than this fraction of the time its client had left at dispatch is late.
LATE_FRACTION = 0.75


def is_late(upstream_s: float, left_at_dispatch_s: float | None,
            ttft_target_s: float | None = None) -> bool:
    """Whether the workers took too long to start answering: `upstream_s` from dispatch to
    the first byte, against LATE_FRACTION of the time the client had left at dispatch (None:
    it said nothing) and the operator's `ttft_target_s`. The wait for admission does not
    count: it is what this limit sets. The gateway and the simulator both judge with this."""
    if ttft_target_s is not None and upstream_s > ttft_target_s:
        return True
    return left_at_dispatch_s is not None and upstream_s > LATE_FRACTION * left_at_dispatch_s


class LatencyLimit:
    """AIMD limit in [floor, ceiling], starting at the ceiling (no loss seen yet)."""

    def __init__(self, ceiling: int, floor: int = 1, decrease: float = 0.5) -> None:
        if not 1 <= floor <= ceiling or not 0.0 < decrease < 1.0:
            raise ValueError("need 1 <= floor <= ceiling and 0 < decrease < 1")
        self.ceiling = ceiling
        self.floor = floor
        self.decrease = decrease
        self._limit = float(ceiling)
        self.generation = 0  # bumped by every cut; admissions remember the one they saw
        self.cuts = 0

    @property
    def limit(self) -> int:
        return int(self._limit)

    def on_time(self, in_flight: int) -> None:
        """A first byte in time; `in_flight` counts the requests open now."""
        if in_flight * 2 >= self._limit:
            self._limit = min(float(self.ceiling), self._limit + 1.0 / self._limit)

    def on_late(self, generation: int, in_flight: int) -> bool:
        """A late first byte, or a client that gave up before it, from a request admitted at
        `generation`. Returns whether the limit was cut."""
        if generation < self.generation:
            return False  # admitted under a limit already cut since
        self._limit = max(float(self.floor), min(self._limit, max(in_flight, 1)) * self.decrease)
        self.generation += 1
        self.cuts += 1
        return True
