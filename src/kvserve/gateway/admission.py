"""Admission control: a bounded number of requests in flight, a bounded queue with a timeout.

The limit is the smaller of `max_in_flight` and what the fleet can run (`fleet_slots`: each
healthy worker's batch capacity plus a little headroom, learned from its /metrics; None while
some worker's is unknown). So in overload the backlog waits here, in arrival order, not in the
workers' queues: a client that leaves costs nothing, and a request that cannot start within
`queue_timeout_s` (or finds `max_queued` ahead of it) is answered 429 with Retry-After before
its client's own timeout fires and it resends, which is how a retry storm starts.

A request is refused on arrival, not after waiting out the timeout, when the queue ahead of it
would take longer than it may wait, at the rate slots have been freed over the last
`RATE_WINDOW_S` (`service_rate`); but not one whose client counts a 429 as one of its few
retries (an SDK, `client_timeout.refusals_spend_retries`), which waits its turn instead
(`acquire(refuse_on_arrival=False)`), since refusing it on arrival each time loses it within
seconds. Retry-After stays `retry_after_s` (1 s): the queue's drain time instead leaves the
fleet idle while clients wait (docs/benchmarks.md, "Gateway").

The queue is ordered by when each request was first asked for (`since`, from
`seniority.Seniority`), not by when this attempt arrived: a client's resend after a 429 or a
timeout goes ahead of every request younger than it, so clients that are told to come back
keep their place, and the refusal on arrival counts only the requests queued ahead of it.

How long a request may wait for its slot is `queue_wait.max_queue_wait`: the operator's
`queue_timeout_s` for a client that says no timeout; for one that says, while it can still be
answered in time (its time left less the recent time from admission to a first byte,
`first_byte(answer_s=...)`), at most `max_queue_wait_s`.

With `latency` the limit is also at most that AIMD limit (`latency_limit.py`), which falls
when admitted requests start answering late and so bounds a fleet whose batch capacity says
nothing of its speed; while `latency_applies()` is False (every worker declares its batch and
enforces its clients' deadlines itself, and the operator set no TTFT target) the AIMD limit
neither bounds nor learns, since a cut there only turns away requests the fleet would have
answered in time.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from kvserve.gateway.latency_limit import LatencyLimit
from kvserve.gateway.queue_wait import DEFAULT_MAX_QUEUE_WAIT_S, AnswerTimes, max_queue_wait

RATE_WINDOW_S = 2.0  # slots freed within this window give the service rate
MIN_RATE_SAMPLES = 8  # fewer freed slots than this in the window: no estimate, just queue


class Saturated(Exception):
    """No slot within the queue limits; `retry_after_s` is what to tell the client."""

    def __init__(self, reason: str, retry_after_s: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass(order=True, slots=True)
class _Waiter:
    """A queued request: ordered by when it was first asked for, then by arrival."""

    since: float
    seq: int
    future: asyncio.Future[None] = field(compare=False)


class Admission:
    """At most `limit` requests run; up to `max_queued` wait for a slot, served in the order
    their requests were first asked for. Call `refresh()` when `fleet_slots` may have grown
    (after a scrape)."""

    def __init__(self, max_in_flight: int, max_queued: int, queue_timeout_s: float,
                 retry_after_s: int = 1,
                 max_queue_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S,
                 fleet_slots: Callable[[], int | None] | None = None,
                 latency: LatencyLimit | None = None,
                 latency_applies: Callable[[], bool] = lambda: True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_in_flight < 1 or max_queued < 0 or queue_timeout_s < 0 or max_queue_wait_s < 0:
            raise ValueError("max_in_flight >= 1, max_queued >= 0, queue_timeout_s >= 0 and "
                             "max_queue_wait_s >= 0")
        self.max_in_flight = max_in_flight
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.max_queue_wait_s = max_queue_wait_s
        self.retry_after_s = retry_after_s
        self.fleet_slots = fleet_slots
        self.latency = latency
        self.latency_applies = latency_applies
        self.clock = clock
        self.in_flight = 0
        self.rejected = 0
        self._waiters: list[_Waiter] = []  # sorted: the most senior first
        self._seq = itertools.count()
        self._freed: deque[float] = deque()  # when slots were freed, within RATE_WINDOW_S
        self.answer_times = AnswerTimes()  # from admission to a first byte

    @property
    def limit(self) -> int:
        """Requests allowed in flight now."""
        limit = self.max_in_flight
        fleet = self.fleet_slots() if self.fleet_slots is not None else None
        if fleet is not None:
            limit = max(1, min(limit, fleet))
        latency = self._active_latency()
        return limit if latency is None else min(limit, latency.limit)

    def _active_latency(self) -> LatencyLimit | None:
        """The AIMD limit, where it applies now."""
        return self.latency if self.latency is not None and self.latency_applies() else None

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def _forget_old_frees(self, now: float) -> None:
        while self._freed and self._freed[0] < now - RATE_WINDOW_S:
            self._freed.popleft()

    def service_rate(self) -> float | None:
        """Slots freed per second, over the span from the oldest free within the last
        RATE_WINDOW_S to now; None with too few to tell. Over the span, not the whole window:
        when a burst has just filled the fleet, the window's first part saw few frees, and
        averaging it in took the rate for a fraction of what the fleet was doing and refused
        requests it would have served in time."""
        now = self.clock()
        self._forget_old_frees(now)
        if len(self._freed) < MIN_RATE_SAMPLES:
            return None
        return (len(self._freed) - 1) / max(now - self._freed[0], 1e-3)

    def expected_wait_s(self, ahead: int | None = None) -> float | None:
        """How long a request queued now behind `ahead` others (default: all queued) would
        wait for its slot; None when unknown."""
        rate = self.service_rate()
        if rate is None:
            return None
        return ((len(self._waiters) if ahead is None else ahead) + 1) / rate

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a slot for the duration of a block; raises Saturated when none comes."""
        await self.acquire()
        try:
            yield
        finally:
            self.release()

    async def acquire(self, deadline: float | None = None, since: float | None = None,
                      refuse_on_arrival: bool = True) -> int:
        """Take a slot (a streamed response releases it when the stream ends) and return the
        latency limit's generation to report the first byte with; raises Saturated when none
        comes within the queue limits. `deadline` (on `clock`): when the client gives up
        (`queue_wait.max_queue_wait`). `since` (on `clock`; default now): when the request
        was first asked for, its place in the queue. Without `refuse_on_arrival` the request
        waits its turn for as long as it may, however long the queue ahead looks (a client
        whose retries a 429 spends)."""
        if not self._waiters and self.in_flight < self.limit:
            self.in_flight += 1
            return self.generation
        if len(self._waiters) >= self.max_queued:
            self.rejected += 1
            raise Saturated("queue full", self.retry_after_s)
        max_wait, reason = max_queue_wait(None if deadline is None else deadline - self.clock(),
                                          self.answer_times.recent_s(), self.queue_timeout_s,
                                          self.max_queue_wait_s)
        entry = _Waiter(self.clock() if since is None else since, next(self._seq),
                        asyncio.get_running_loop().create_future())
        ahead = bisect.bisect(self._waiters, entry)
        wait = self.expected_wait_s(ahead) if refuse_on_arrival else None
        if wait is not None and wait > max_wait:
            self.rejected += 1
            raise Saturated("queue wait", self.retry_after_s)
        self._waiters.insert(ahead, entry)
        waiter = entry.future
        try:
            async with asyncio.timeout(max_wait):
                await waiter
        except TimeoutError:
            self._abandon(entry)
            self.rejected += 1
            raise Saturated(reason, self.retry_after_s) from None
        except BaseException:  # cancelled: the client left while queued
            self._abandon(entry)
            raise
        return self.generation

    @property
    def generation(self) -> int:
        return 0 if self.latency is None else self.latency.generation

    def first_byte(self, generation: int, late: bool, answer_s: float | None = None) -> None:
        """A request admitted at `generation` started answering, `late` or in time, `answer_s`
        seconds after its admission (it still holds its slot)."""
        if answer_s is not None:
            self.answer_times.add(answer_s)
        latency = self._active_latency()
        if latency is None:
            return
        if late:
            latency.on_late(generation, self.in_flight)
        else:
            latency.on_time(self.in_flight)
            self.refresh()

    def gave_up(self, generation: int, waited_s: float | None = None) -> None:
        """The client of a request admitted at `generation` left before its first byte,
        `waited_s` after its admission (it timed out: the fleet answers too slowly for it).
        Call before `release`."""
        if waited_s is not None:
            self.answer_times.add(waited_s)  # its answer would have taken at least that
        latency = self._active_latency()
        if latency is not None:
            latency.on_late(generation, self.in_flight)

    def release(self) -> None:
        self.in_flight -= 1
        now = self.clock()
        self._freed.append(now)
        self._forget_old_frees(now)  # bounded by the window's throughput
        self.refresh()

    def refresh(self) -> None:
        """Hand free slots to the most senior queued requests."""
        limit = self.limit
        while self._waiters and self.in_flight < limit:
            waiter = self._waiters.pop(0).future
            if not waiter.done():
                self.in_flight += 1
                waiter.set_result(None)

    def _abandon(self, entry: _Waiter) -> None:
        if entry.future.done() and not entry.future.cancelled():
            self.in_flight -= 1  # handed a slot just as it gave up: pass it on
            self.refresh()
            return
        entry.future.cancel()
        index = bisect.bisect_left(self._waiters, entry)
        if index < len(self._waiters) and self._waiters[index] is entry:
            del self._waiters[index]
