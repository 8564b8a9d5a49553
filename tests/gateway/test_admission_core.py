"""The pure admission state machine: who runs, who waits in which order, who is refused and why,
on an injected clock (no asyncio, no sleeping)."""

from __future__ import annotations

import pytest

from kvserve.gateway.core.admission_core import (
    AdmissionCore,
    AdmissionLimits,
    Ticket,
    TicketState,
)
from kvserve.gateway.core.latency_limit import LatencyLimit


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def core(max_in_flight: int, max_queued: int = 100, queue_timeout_s: float = 1.0,
         **kwargs: object) -> tuple[AdmissionCore, FakeClock]:
    clock = FakeClock()
    return AdmissionCore(AdmissionLimits(max_in_flight, max_queued, queue_timeout_s),
                         clock=clock, **kwargs), clock  # type: ignore[arg-type]


def _fill_and_serve_ten(admission: AdmissionCore, clock: FakeClock,
                        every_s: float = 0.125) -> list[Ticket]:
    """Fill 10 slots, then free and refill one every `every_s`, ten times: 10 freed within
    the 2 s rate window, 8 a second by default (9 intervals in 1.125 s)."""
    held = [admission.arrive() for _ in range(10)]
    assert all(t.state is TicketState.ADMITTED for t in held)
    assert admission.expected_wait_s() is None  # nothing freed yet: no rate to go by
    for _ in range(10):
        clock.now += every_s
        admission.release(held.pop(0))
        held.append(admission.arrive())
    return held


def test_queued_tickets_are_admitted_in_arrival_order_as_slots_free() -> None:
    admission, _ = core(1, queue_timeout_s=5.0)
    running = admission.arrive()
    queued = [admission.arrive() for _ in range(3)]
    assert [t.state for t in queued] == [TicketState.QUEUED] * 3
    order = []
    for _ in range(3):
        admitted = admission.release(running)
        assert len(admitted) == 1
        running = admitted[0]
        order.append(queued.index(running))
    assert order == [0, 1, 2] and admission.queued == 0 and admission.in_flight == 1


def test_an_expired_ticket_is_refused_and_one_admitted_in_time_keeps_its_slot() -> None:
    admission, clock = core(1, queue_timeout_s=0.5)
    running = admission.arrive()
    late, lucky = admission.arrive(), admission.arrive()
    assert late.expires_at == clock.now + 0.5
    assert admission.expire(late) and late.refusal == "queue timeout"
    assert admission.rejected == 1 and admission.queued == 1
    assert admission.release(running) == [lucky]
    assert not admission.expire(lucky)  # admitted just as its wait ran out: it runs
    assert lucky.state is TicketState.ADMITTED


def test_a_ticket_that_leaves_frees_its_place_or_its_slot_once() -> None:
    admission, _ = core(1)
    running = admission.arrive()
    gone, nxt = admission.arrive(), admission.arrive()
    assert admission.leave(gone) == [] and admission.queued == 1
    assert admission.leave(running) == [nxt]  # left after admission: its slot goes on
    assert admission.release(running) == []  # released twice: nothing more is freed
    assert admission.in_flight == 1


def test_a_full_queue_refuses_at_once() -> None:
    admission, _ = core(1, max_queued=0)
    admission.arrive()
    refused = admission.arrive()
    assert refused.state is TicketState.REFUSED and refused.refusal == "queue full"


def test_the_limit_follows_the_fleet_and_grows_back_on_refresh() -> None:
    slots: list[int | None] = [None]
    admission, _ = core(100, fleet_slots=lambda: slots[0])
    held = [admission.arrive() for _ in range(3)]
    slots[0] = 2
    late = admission.arrive()
    assert admission.limit == 2 and late.state is TicketState.QUEUED
    assert admission.release(held.pop()) == []  # 2 in flight: still at the limit
    slots[0] = 4
    assert admission.refresh() == [late]


def test_a_queue_longer_than_its_wait_is_refused_at_once() -> None:
    admission, clock = core(10)
    _fill_and_serve_ten(admission, clock)
    assert admission.service_rate() == 8.0  # per second, over the span of the frees
    queued = [admission.arrive() for _ in range(8)]
    assert all(t.state is TicketState.QUEUED for t in queued)  # the 8th: 1 s, within 1 s
    ninth = admission.arrive()  # 9 / (8 per s) = 1.125 s > 1 s
    assert ninth.state is TicketState.REFUSED and ninth.refusal == "queue wait"
    clock.now += 10.0  # the rate's window is stale: no estimate, so it queues again
    assert admission.service_rate() is None
    assert admission.arrive().state is TicketState.QUEUED


def test_the_service_rate_spans_the_frees_not_the_whole_window() -> None:
    admission, clock = core(10)
    _fill_and_serve_ten(admission, clock, every_s=0.05)
    assert admission.service_rate() == pytest.approx(20.0)
    queued = [admission.arrive() for _ in range(15)]
    assert all(t.state is TicketState.QUEUED for t in queued) and admission.rejected == 0
    clock.now += 1.5  # no free since: the rate decays with the time since the first
    assert admission.service_rate() == pytest.approx(9 / 1.95)


def test_the_rate_window_stays_bounded_without_a_queue() -> None:
    admission, clock = core(4, max_queued=8)
    for _ in range(10_000):  # hours of traffic that never queues
        ticket = admission.arrive()
        clock.now += 0.01
        admission.release(ticket)
    assert len(admission._freed.times) <= 2.0 / 0.01 + 1


def test_a_resend_queues_ahead_of_requests_younger_than_its_first_send() -> None:
    admission, clock = core(1, queue_timeout_s=5.0)
    running = admission.arrive()
    names = {}
    for name, since in (("new-1", None), ("new-2", None), ("resend", 90.0),
                        ("older-resend", 80.0), ("new-3", None)):
        clock.now += 1.0
        names[admission.arrive(since=since)] = name
    order = []
    for _ in range(5):
        (running,) = admission.release(running)
        order.append(names[running])
    assert order == ["older-resend", "resend", "new-1", "new-2", "new-3"]


def test_the_refusal_on_arrival_counts_only_the_requests_ahead() -> None:
    admission, clock = core(10)
    held = _fill_and_serve_ten(admission, clock)
    queued = [admission.arrive() for _ in range(8)]
    assert admission.arrive().state is TicketState.REFUSED
    senior = admission.arrive(since=50.0)  # first sent long ago: nobody is ahead of it
    assert senior.state is TicketState.QUEUED
    assert admission.release(held[0]) == [senior]
    assert all(t.state is TicketState.QUEUED for t in queued)


def test_a_request_whose_retries_a_429_spends_waits_its_turn_instead() -> None:
    admission, clock = core(10)
    held = _fill_and_serve_ten(admission, clock)
    [admission.arrive() for _ in range(8)]
    assert admission.arrive().state is TicketState.REFUSED
    patient = admission.arrive(refuse_on_arrival=False)
    assert patient.state is TicketState.QUEUED and admission.rejected == 1
    admitted = [t for ticket in held[:9] for t in admission.release(ticket)]
    assert admitted[-1] is patient


def test_a_client_deadline_bounds_the_wait_with_its_reason() -> None:
    admission, clock = core(1, queue_timeout_s=5.0)
    admission.arrive()
    hurried = admission.arrive(deadline=clock.now + 0.4)
    assert hurried.expires_at == pytest.approx(clock.now + 0.2)  # half its time left
    assert admission.expire(hurried) and hurried.refusal == "deadline"


def test_late_answers_cut_the_limit_once_per_generation_and_answers_in_time_admit() -> None:
    latency = LatencyLimit(ceiling=8, floor=1)
    admission, _ = core(8, latency=latency)
    held = [admission.arrive() for _ in range(4)]
    admission.first_byte(held[0], late=True, answer_s=None)  # 4 in flight: the limit falls to 2
    admission.first_byte(held[1], late=True, answer_s=None)  # same generation: no second cut
    assert admission.limit == 2 and admission.generation == 1
    admission.release(held[0])
    admission.release(held[1])
    queued = admission.arrive()
    assert queued.state is TicketState.QUEUED
    assert admission.first_byte(held[2], late=False, answer_s=0.1) == []  # 2 -> 2.5
    assert admission.first_byte(held[2], late=False, answer_s=0.1) == []  # -> 2.9
    assert admission.first_byte(held[2], late=False, answer_s=0.1) == [queued]  # -> 3.24
    assert queued.generation == 1
    admission.gave_up(queued, waited_s=1.0)  # its client left before a first byte
    assert admission.limit == 1 and admission.generation == 2


def test_retries_are_a_fraction_of_what_was_admitted() -> None:
    from kvserve.gateway.core.retry_budget import RetryBudget

    admission, _ = core(100, retry_budget=RetryBudget(ratio=0.5, min_per_s=0.0, balance=0.0))
    assert not admission.may_retry()
    admission.arrive()
    admission.arrive()  # two admitted: one retry's worth
    assert admission.may_retry() and not admission.may_retry()
