"""Admission as one pure state machine: how many requests run, who waits, who is refused.

Pure and clock-injected (no asyncio, no HTTP): kvserve's proxy and the Endpoint Picker drive it
through `admission.Admission`, the fleet simulator drives it from its event queue, and all three
give the same verdicts for the same arrivals (tests/gateway/test_admission_agreement.py).

The rules:
- At most `limit` requests run: the smallest of `max_in_flight`, what the fleet can run
  (`fleet_slots`: each worker's batch plus a little headroom, learned from its /metrics) and,
  where it applies, the AIMD latency limit (`latency_limit.py`). So in overload the backlog
  waits here, not in the workers' queues, where a client that leaves costs nothing.
- Up to `max_queued` wait, ordered by when each request was first asked for (`since`), so a
  client's resend keeps the place its first send took (`seniority.py`).
- A queued request waits at most `queue_wait.max_queue_wait` (its client's time left, the
  operator's bounds), then is refused with 429 and Retry-After before its client's own timeout
  fires and it resends, which is how a retry storm starts.
- A request is refused on arrival when the queue ahead of it would take longer than it may wait,
  at the rate slots were freed lately, unless its client counts a 429 as one of its few retries
  (an OpenAI SDK): that one waits its turn, since refusing it each time loses it in seconds.
- Retries to another worker may add at most a fraction of the request rate (`retry_budget`).

A request is a `Ticket`; every call that can free a slot returns the tickets it admitted, which
the front end then starts.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.gateway.core.latency_limit import LatencyLimit
from kvserve.gateway.core.queue_wait import DEFAULT_MAX_QUEUE_WAIT_S, AnswerTimes, max_queue_wait
from kvserve.gateway.core.retry_budget import RetryBudget

RATE_WINDOW_S = 2.0  # slots freed within this window give the service rate
MIN_RATE_SAMPLES = 8  # fewer freed slots than this in the window: no estimate, just queue


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """The operator's bounds (`kvserve gateway`'s admission flags, the simulator's
    backpressure)."""

    max_in_flight: int = 256
    max_queued: int = 512
    queue_timeout_s: float = 1.0  # the wait of a client that says no timeout
    max_queue_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S  # the longest wait, whatever it says
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if (self.max_in_flight < 1 or self.max_queued < 0 or self.queue_timeout_s < 0
                or self.max_queue_wait_s < 0 or self.retry_after_s < 1):
            raise ValueError("max_in_flight >= 1, max_queued >= 0, queue_timeout_s >= 0, "
                             "max_queue_wait_s >= 0 and retry_after_s >= 1")


class TicketState(enum.Enum):
    QUEUED = "queued"
    ADMITTED = "admitted"
    REFUSED = "refused"  # answer 429 with `Ticket.refusal` and `retry_after_s`
    DONE = "done"  # released, or left the queue


@dataclass(eq=False, slots=True)
class Ticket:
    """One request's passage through admission; compared by identity."""

    since: float  # its place in the queue
    seq: int
    state: TicketState
    expires_at: float = 0.0  # when a queued ticket is refused (`AdmissionCore.expire`)
    wait_reason: str = "queue timeout"  # the 429's reason if it expires
    refusal: str | None = None
    generation: int = 0  # the latency limit's when admitted


@dataclass(slots=True)
class _Freed:
    """When slots were freed, within RATE_WINDOW_S of the last one."""

    times: deque[float] = field(default_factory=deque)

    def add(self, now: float) -> None:
        self.times.append(now)
        self.forget(now)

    def forget(self, now: float) -> None:
        while self.times and self.times[0] < now - RATE_WINDOW_S:
            self.times.popleft()


class AdmissionCore:
    """The state machine of the module doc. Not thread-safe: one event loop (or one simulated
    clock) drives it."""

    def __init__(self, limits: AdmissionLimits,
                 fleet_slots: Callable[[], int | None] | None = None,
                 latency: LatencyLimit | None = None,
                 latency_applies: Callable[[], bool] = lambda: True,
                 retry_budget: RetryBudget | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.fleet_slots = fleet_slots
        self.latency = latency
        self.latency_applies = latency_applies
        self.retry_budget = retry_budget if retry_budget is not None else RetryBudget()
        self.clock = clock
        self.in_flight = 0
        self.rejected = 0
        self._queue: list[tuple[float, int, Ticket]] = []  # sorted: the most senior first
        self._seq = itertools.count()
        self._freed = _Freed()
        self.answer_times = AnswerTimes()  # from admission to a first byte

    # -- what it knows ----------------------------------------------------------------------

    @property
    def limit(self) -> int:
        """Requests allowed in flight now."""
        limit = self.limits.max_in_flight
        fleet = self.fleet_slots() if self.fleet_slots is not None else None
        if fleet is not None:
            limit = max(1, min(limit, fleet))
        latency = self._active_latency()
        return limit if latency is None else min(limit, latency.limit)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def generation(self) -> int:
        return 0 if self.latency is None else self.latency.generation

    def service_rate(self) -> float | None:
        """Slots freed per second, over the span from the oldest free within the last
        RATE_WINDOW_S to now (not the whole window: just after a burst filled the fleet, the
        window's start saw few frees); None with too few to tell."""
        now = self.clock()
        self._freed.forget(now)
        times = self._freed.times
        if len(times) < MIN_RATE_SAMPLES:
            return None
        return (len(times) - 1) / max(now - times[0], 1e-3)

    def expected_wait_s(self, ahead: int | None = None) -> float | None:
        """How long a request queued now behind `ahead` others (default: all queued) would
        wait for its slot; None when unknown."""
        rate = self.service_rate()
        if rate is None:
            return None
        return ((len(self._queue) if ahead is None else ahead) + 1) / rate

    # -- transitions ------------------------------------------------------------------------

    def arrive(self, deadline: float | None = None, since: float | None = None,
               refuse_on_arrival: bool = True) -> Ticket:
        """A request asks for a slot: the ticket comes back ADMITTED, QUEUED (until
        `expires_at`: call `expire` then) or REFUSED. `deadline` (on `clock`): when its
        client gives up; `since` (default now): when it was first asked for."""
        now = self.clock()
        ticket = Ticket(now if since is None else since, next(self._seq), TicketState.QUEUED)
        if not self._queue and self.in_flight < self.limit:
            self._admit(ticket)
            return ticket
        if len(self._queue) >= self.limits.max_queued:
            return self._refuse(ticket, "queue full")
        wait_s, ticket.wait_reason = max_queue_wait(
            None if deadline is None else deadline - now, self.answer_times.recent_s(),
            self.limits.queue_timeout_s, self.limits.max_queue_wait_s)
        entry = (ticket.since, ticket.seq, ticket)
        ahead = bisect.bisect(self._queue, entry[:2])
        expected = self.expected_wait_s(ahead) if refuse_on_arrival else None
        if expected is not None and expected > wait_s:
            return self._refuse(ticket, "queue wait")
        ticket.expires_at = now + wait_s
        self._queue.insert(ahead, entry)
        return ticket

    def expire(self, ticket: Ticket) -> bool:
        """Its wait is over: a ticket still queued is refused (True); one admitted meanwhile
        keeps its slot (False)."""
        if ticket.state is not TicketState.QUEUED:
            return False
        self._dequeue(ticket)
        self._refuse(ticket, ticket.wait_reason)
        return True

    def leave(self, ticket: Ticket) -> list[Ticket]:
        """Its client left: out of the queue, or its slot released."""
        if ticket.state is TicketState.QUEUED:
            self._dequeue(ticket)
            ticket.state = TicketState.DONE
            return []
        return self.release(ticket)

    def release(self, ticket: Ticket) -> list[Ticket]:
        """An admitted request ended, however it ended; a ticket released before is ignored."""
        if ticket.state is not TicketState.ADMITTED:
            return []
        ticket.state = TicketState.DONE
        self.in_flight -= 1
        self._freed.add(self.clock())
        return self.refresh()

    def first_byte(self, ticket: Ticket, late: bool, answer_s: float | None) -> list[Ticket]:
        """An admitted request started answering, `late` or in time (`latency_limit.is_late`),
        `answer_s` after its admission."""
        if answer_s is not None:
            self.answer_times.add(answer_s)
        latency = self._active_latency()
        if latency is None:
            return []
        if late:
            latency.on_late(ticket.generation, self.in_flight)
            return []
        latency.on_time(self.in_flight)
        return self.refresh()

    def gave_up(self, ticket: Ticket, waited_s: float | None) -> None:
        """The client of an admitted request left before its first byte, `waited_s` after its
        admission: the fleet answers too slowly for it. Call before `release`."""
        if waited_s is not None:
            self.answer_times.add(waited_s)  # its answer would have taken at least that
        latency = self._active_latency()
        if latency is not None:
            latency.on_late(ticket.generation, self.in_flight)

    def refresh(self) -> list[Ticket]:
        """Hand free slots to the most senior queued requests (call when the limit may have
        grown, e.g. after a scrape); returns them."""
        admitted = []
        limit = self.limit
        while self._queue and self.in_flight < limit:
            ticket = self._queue.pop(0)[2]
            self._admit(ticket)
            admitted.append(ticket)
        return admitted

    def may_retry(self) -> bool:
        """Whether one more attempt at another worker fits the retry budget (spends it)."""
        return self.retry_budget.try_spend(self.clock())

    # -- internals --------------------------------------------------------------------------

    def _active_latency(self) -> LatencyLimit | None:
        return self.latency if self.latency is not None and self.latency_applies() else None

    def _admit(self, ticket: Ticket) -> None:
        self.retry_budget.on_request(self.clock())  # retries are a fraction of what went upstream
        ticket.state = TicketState.ADMITTED
        ticket.generation = self.generation
        self.in_flight += 1

    def _refuse(self, ticket: Ticket, reason: str) -> Ticket:
        ticket.state, ticket.refusal = TicketState.REFUSED, reason
        self.rejected += 1
        return ticket

    def _dequeue(self, ticket: Ticket) -> None:
        index = bisect.bisect_left(self._queue, (ticket.since, ticket.seq))
        if index < len(self._queue) and self._queue[index][2] is ticket:
            del self._queue[index]
