"""Requests the workers serve that this gateway did not send: the sign that it is one of several
gateway replicas (or that clients bypass it), read from every scrape, two ways.

Running: when a scrape of a worker is sent, the gateway has `in_flight` requests there, and it
sends `sent_during` more before the answer comes back. The worker's `running + waiting` can
include at most those of the gateway's own, so at least `reported - (in_flight + sent_during)`
came from somewhere else. A request shows this way only while it runs or waits, so at light
load (requests of tens of milliseconds, scraped once a second) most are never seen.

Finished: the worker's count of finished requests (`vllm:request_success_total`, kvserve's and
vLLM's) grows by `finished` between two scrapes' answers. Of the gateway's own, only those in
flight when the earlier scrape went out, sent since, or abandoned since the scrape before it (a
worker counts an abandoned request once it notices) can be among them, so at least `finished -
(in_flight then + sent since + abandoned lately)` came from elsewhere. Every request shows
once, however short; but the gateway's own in flight loosen the bound as load grows, where the
running count is the sharper one. Both are lower bounds that the timing of the gateway's own
traffic never raises (its requests in transit, finishing, or aborted but not yet noticed by the
worker only lower them), and each is judged over its own window; the workers are shared when
either says so.

Over a window of scrapes, the foreign share of what the workers reported tells a gateway alone
on its workers (about 0) from one of k replicas behind an even balancer (about (k - 1) / k).
A verdict changes only on evidence: it turns on once the window holds `min_foreign` foreign
requests making at least `min_share` of the load, and off once the window holds `min_foreign`
reported requests of which under half that share are foreign. An idle fleet keeps the last
verdict.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

DEFAULT_WINDOW_S = 60.0
DEFAULT_MIN_SHARE = 0.2
DEFAULT_MIN_FOREIGN = 4


@dataclass(slots=True)
class _Window:
    """One signal's foreign and reported requests over the last `window_s` seconds, and its
    verdict."""

    window_s: float
    min_share: float
    min_foreign: int
    shared: bool = False
    _samples: deque[tuple[float, int, int]] = field(default_factory=deque)
    _foreign: int = 0
    _reported: int = 0

    def add(self, now: float, reported: int, own_at_most: int) -> int:
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
        return self._foreign / self._reported if self._reported else 0.0


@dataclass(slots=True)
class ForeignLoad:
    """The foreign requests seen on the workers over the last `window_s` seconds of scrapes,
    running (`record`) and finished (`record_finished`)."""

    window_s: float = DEFAULT_WINDOW_S
    min_share: float = DEFAULT_MIN_SHARE
    min_foreign: int = DEFAULT_MIN_FOREIGN
    _running: _Window = field(init=False)
    _finished: _Window = field(init=False)

    def __post_init__(self) -> None:
        if not (self.window_s > 0 and 0 < self.min_share <= 1 and self.min_foreign >= 1):
            raise ValueError(f"ForeignLoad needs window_s > 0, 0 < min_share <= 1 and "
                             f"min_foreign >= 1, got {self.window_s}, {self.min_share}, "
                             f"{self.min_foreign}")
        self._running = _Window(self.window_s, self.min_share, self.min_foreign)
        self._finished = _Window(self.window_s, self.min_share, self.min_foreign)

    def record(self, now: float, reported: int, own_at_most: int) -> int:
        """One scrape of a worker that reported `reported` requests (running + waiting) while
        the gateway had at most `own_at_most` of its own there; returns the foreign requests
        (the lower bound, >= 0) and updates the verdict."""
        return self._running.add(now, reported, own_at_most)

    def record_finished(self, now: float, finished: int, own_at_most: int) -> int:
        """A worker finished `finished` requests since its previous scrape, of which at most
        `own_at_most` can be the gateway's (in flight when that scrape went out, or sent
        since); returns the foreign ones (the lower bound, >= 0) and updates the verdict."""
        return self._finished.add(now, finished, own_at_most)

    @property
    def shared(self) -> bool:
        """Whether either signal says other routers' requests reach these workers."""
        return self._running.shared or self._finished.shared

    @property
    def share(self) -> float:
        """Foreign requests over requests the workers reported, in the window, by the signal
        that sees more of them (0 when none)."""
        return max(self._running.share, self._finished.share)
