"""Requests the workers serve that this gateway did not send: the sign that it is one of several
gateway replicas (or that clients bypass it), read from every scrape.

When a scrape of a worker is sent, the gateway has `in_flight` requests there, and it sends
`sent_during` more before the answer comes back. The worker's `running + waiting` can include at
most those of the gateway's own, so at least `reported - (in_flight + sent_during)` came from
somewhere else: a lower bound that the timing of the gateway's own traffic never raises (its
requests in transit, finishing, or aborted but not yet noticed by the worker only lower it).

Over a window of scrapes, the foreign share of what the workers reported tells a gateway alone
on its workers (about 0) from one of k replicas behind an even balancer (about (k - 1) / k).
The verdict (`shared`) changes only on evidence: it turns on once the window holds
`min_foreign` foreign requests making at least `min_share` of the load, and off once the window
holds `min_foreign` reported requests of which under half that share are foreign. An idle fleet
keeps the last verdict.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

DEFAULT_WINDOW_S = 60.0
DEFAULT_MIN_SHARE = 0.2
DEFAULT_MIN_FOREIGN = 4


@dataclass(slots=True)
class ForeignLoad:
    """The foreign requests seen on the workers over the last `window_s` seconds of scrapes."""

    window_s: float = DEFAULT_WINDOW_S
    min_share: float = DEFAULT_MIN_SHARE
    min_foreign: int = DEFAULT_MIN_FOREIGN
    shared: bool = False
    _samples: deque[tuple[float, int, int]] = field(default_factory=deque)
    _foreign: int = 0
    _reported: int = 0

    def __post_init__(self) -> None:
        if not (self.window_s > 0 and 0 < self.min_share <= 1 and self.min_foreign >= 1):
            raise ValueError(f"ForeignLoad needs window_s > 0, 0 < min_share <= 1 and "
                             f"min_foreign >= 1, got {self.window_s}, {self.min_share}, "
                             f"{self.min_foreign}")

    def record(self, now: float, reported: int, own_at_most: int) -> int:
        """One scrape of a worker that reported `reported` requests (running + waiting) while
        the gateway had at most `own_at_most` of its own there; returns the foreign requests
        (the lower bound, >= 0) and updates `shared`."""
        foreign = max(0, reported - max(0, own_at_most))
        self._samples.append((now, foreign, max(0, reported)))
        self._foreign += foreign
        self._reported += max(0, reported)
        while self._samples and self._samples[0][0] < now - self.window_s:
            _, old_foreign, old_reported = self._samples.popleft()
            self._foreign -= old_foreign
            self._reported -= old_reported
        share = self.share
        if not self.shared and self._foreign >= self.min_foreign and share >= self.min_share:
            self.shared = True
        elif self.shared and self._reported >= self.min_foreign and share < self.min_share / 2:
            self.shared = False
        return foreign

    @property
    def share(self) -> float:
        """Foreign requests over requests the workers reported, in the window (0 when none)."""
        return self._foreign / self._reported if self._reported else 0.0
