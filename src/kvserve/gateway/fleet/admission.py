"""Admission for an asyncio front end (kvserve's proxy, the Endpoint Picker): the pure state
machine of `admission_core`, with a queued request's wait as an awaited future.

`await admit(...)` returns a `Slot` or raises `Saturated`; the slot is released in exactly one
place by its holder (`with slot:`, or `release()`, which is idempotent), however the request
ends: answered, failed, timed out or abandoned by its client.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from kvserve.gateway.core.admission_core import (
    AdmissionCore,
    AdmissionLimits,
    Ticket,
    TicketState,
)
from kvserve.gateway.core.latency_limit import LatencyLimit
from kvserve.gateway.core.queue_wait import DEFAULT_MAX_QUEUE_WAIT_S, AnswerTimes
from kvserve.gateway.core.retry_budget import RetryBudget


class Saturated(Exception):
    """No slot within the queue limits; `retry_after_s` is what to tell the client."""

    def __init__(self, reason: str, retry_after_s: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s


class Slot:
    """An admitted request's hold on the fleet, until `release` (or the end of a `with`)."""

    __slots__ = ("_admission", "released", "ticket")

    def __init__(self, admission: Admission, ticket: Ticket) -> None:
        self._admission = admission
        self.ticket = ticket
        self.released = False

    @property
    def generation(self) -> int:
        """The latency limit's generation when it was admitted."""
        return self.ticket.generation

    def first_byte(self, late: bool, answer_s: float | None = None) -> None:
        """The answer started, `late` or in time, `answer_s` after admission."""
        self._admission.wake(self._admission.core.first_byte(self.ticket, late, answer_s))

    def gave_up(self, waited_s: float | None = None) -> None:
        """Its client left before a first byte, `waited_s` after admission (before release)."""
        self._admission.core.gave_up(self.ticket, waited_s)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._admission.wake(self._admission.core.release(self.ticket))

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Admission:
    """The asyncio face of one `AdmissionCore`. Call `refresh()` when the fleet's slots may
    have grown (after a scrape)."""

    def __init__(self, max_in_flight: int, max_queued: int, queue_timeout_s: float,
                 retry_after_s: int = 1, max_queue_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S,
                 fleet_slots: Callable[[], int | None] | None = None,
                 latency: LatencyLimit | None = None,
                 latency_applies: Callable[[], bool] = lambda: True,
                 retry_budget: RetryBudget | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        limits = AdmissionLimits(max_in_flight, max_queued, queue_timeout_s, max_queue_wait_s,
                                 retry_after_s)
        self.core = AdmissionCore(limits, fleet_slots, latency, latency_applies, retry_budget,
                                  clock)
        self._waiting: dict[Ticket, asyncio.Future[None]] = {}

    @property
    def limits(self) -> AdmissionLimits:
        return self.core.limits

    @property
    def limit(self) -> int:
        return self.core.limit

    @property
    def in_flight(self) -> int:
        return self.core.in_flight

    @property
    def queued(self) -> int:
        return self.core.queued

    @property
    def rejected(self) -> int:
        return self.core.rejected

    @property
    def latency(self) -> LatencyLimit | None:
        return self.core.latency

    @property
    def retry_budget(self) -> RetryBudget:
        return self.core.retry_budget

    @property
    def answer_times(self) -> AnswerTimes:
        return self.core.answer_times

    def service_rate(self) -> float | None:
        return self.core.service_rate()

    def expected_wait_s(self, ahead: int | None = None) -> float | None:
        return self.core.expected_wait_s(ahead)

    async def admit(self, deadline: float | None = None, since: float | None = None,
                    refuse_on_arrival: bool = True) -> Slot:
        """A slot, once one is free within the queue limits; raises Saturated otherwise.
        `deadline`, `since` and `refuse_on_arrival` as `AdmissionCore.arrive` takes them."""
        core = self.core
        ticket = core.arrive(deadline, since, refuse_on_arrival)
        if ticket.state is TicketState.QUEUED:
            future = asyncio.get_running_loop().create_future()
            self._waiting[ticket] = future
            try:
                async with asyncio.timeout(max(0.0, ticket.expires_at - core.clock())):
                    await future
            except TimeoutError:
                core.expire(ticket)  # refused, unless admitted just as its wait ran out
            except BaseException:  # cancelled: the client left while queued (or just admitted)
                self.wake(core.leave(ticket))
                raise
            finally:
                del self._waiting[ticket]
        if ticket.state is TicketState.REFUSED:
            assert ticket.refusal is not None
            raise Saturated(ticket.refusal, core.limits.retry_after_s)
        return Slot(self, ticket)

    def refresh(self) -> None:
        """Hand free slots to the most senior queued requests."""
        self.wake(self.core.refresh())

    def wake(self, admitted: list[Ticket]) -> None:
        """Resume the queued requests the core just admitted."""
        for ticket in admitted:
            future = self._waiting.get(ticket)
            if future is not None and not future.done():
                future.set_result(None)
