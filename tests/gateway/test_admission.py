"""Admission: first come first served, a limit that follows the fleet's learned capacity, and
no slot lost to a request that times out or leaves while queued."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.gateway.admission import Admission, Saturated
from kvserve.gateway.scraper import apply_metrics
from kvserve.gateway.worker_pool import WorkerPool, WorkerState, worker_slots


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_queued_requests_get_slots_in_arrival_order() -> None:
    async def scenario() -> None:
        admission = Admission(1, 8, 5.0)
        await admission.acquire()
        order: list[int] = []

        async def waiter(i: int) -> None:
            await admission.acquire()
            order.append(i)

        tasks = [asyncio.create_task(waiter(i)) for i in range(4)]
        await _settle()
        assert admission.queued == 4 and admission.in_flight == 1
        for _ in range(4):
            admission.release()
            await _settle()
        assert order == [0, 1, 2, 3]
        await asyncio.gather(*tasks)
        assert admission.in_flight == 1 and admission.queued == 0

    run(scenario())


def test_the_limit_follows_the_fleet_and_grows_back_on_refresh() -> None:
    async def scenario() -> None:
        slots: list[int | None] = [None]
        admission = Admission(100, 100, 5.0, fleet_slots=lambda: slots[0])
        assert admission.limit == 100  # capacity unknown: the configured bound
        for _ in range(3):
            await admission.acquire()
        slots[0] = 2  # the workers were seen full: three in flight is already over
        assert admission.limit == 2
        late = asyncio.create_task(admission.acquire())
        await _settle()
        assert not late.done() and admission.queued == 1
        admission.release()
        await _settle()
        assert not late.done()  # 2 in flight: still at the limit
        slots[0] = 4
        admission.refresh()  # what the scraper does after each round
        await _settle()
        assert late.done() and admission.in_flight == 3

    run(scenario())


def test_a_timed_out_or_departed_waiter_holds_no_slot() -> None:
    async def scenario() -> None:
        admission = Admission(1, 8, 0.05)
        await admission.acquire()
        with pytest.raises(Saturated) as info:
            await admission.acquire()
        assert info.value.reason == "queue timeout" and admission.rejected == 1
        assert admission.queued == 0
        gone = asyncio.create_task(admission.acquire())
        nxt = asyncio.create_task(admission.acquire())
        await _settle()
        gone.cancel()  # the client left while queued
        await asyncio.gather(gone, return_exceptions=True)
        admission.release()
        await _settle()
        assert nxt.done() and admission.in_flight == 1 and admission.queued == 0

    run(scenario())


def test_a_slot_handed_over_as_its_waiter_leaves_is_passed_on() -> None:
    async def scenario() -> None:
        admission = Admission(1, 8, 5.0)
        await admission.acquire()
        first = asyncio.create_task(admission.acquire())
        second = asyncio.create_task(admission.acquire())
        await _settle()
        admission.release()  # hands the slot to `first`...
        first.cancel()  # ...which is cancelled before it runs again
        await asyncio.gather(first, return_exceptions=True)
        await _settle()
        assert second.done() and admission.in_flight == 1

    run(scenario())


def test_a_full_queue_rejects_at_once() -> None:
    async def scenario() -> None:
        admission = Admission(1, 0, 5.0)
        await admission.acquire()
        with pytest.raises(Saturated) as info:
            await admission.acquire()
        assert info.value.reason == "queue full"

    run(scenario())


def _exposition(running: int, waiting: int) -> str:
    return (f"vllm:num_requests_running{{model_name=\"m\"}} {running}\n"
            f"vllm:num_requests_waiting{{model_name=\"m\"}} {waiting}\n")


def test_a_worker_s_batch_capacity_is_learned_when_it_queues() -> None:
    worker = WorkerState("http://w")
    apply_metrics(worker, _exposition(5, 0))
    assert worker.batch_capacity == 0  # not full: 5 says nothing about its limit
    apply_metrics(worker, _exposition(16, 3))
    assert worker.batch_capacity == 16
    apply_metrics(worker, _exposition(2, 1))  # fewer fit (long prompts): the batch limit stays
    assert worker.batch_capacity == 16
    apply_metrics(worker, _exposition(20, 0))  # it ran the quarter more it was let have
    assert worker.batch_capacity == 20  # 16 was not its limit
    apply_metrics(worker, _exposition(3, 0))
    assert worker.batch_capacity == 20


def test_a_kvserve_worker_s_declared_batch_needs_no_queue_to_learn() -> None:
    worker = WorkerState("http://w")
    apply_metrics(worker, _exposition(0, 0) + 'kvserve:max_num_seqs{model_name="m"} 16\n')
    assert worker.batch_capacity == 16


def test_without_learned_capacity_only_declared_batches_bound_the_fleet() -> None:
    pool = WorkerPool(["http://kvserve", "http://vllm"])
    apply_metrics(pool.get("http://kvserve"),
                  _exposition(0, 0) + 'kvserve:max_num_seqs{model_name="m"} 16\n')
    apply_metrics(pool.get("http://vllm"), _exposition(4, 9))  # seen full at 4
    assert pool.fleet_slots(0.0) == worker_slots(16) + worker_slots(4)
    assert pool.fleet_slots(0.0, learned=False) is None  # the vLLM worker has not said
    only_declared = WorkerPool(["http://kvserve"])
    apply_metrics(only_declared.get("http://kvserve"),
                  _exposition(0, 0) + 'kvserve:max_num_seqs{model_name="m"} 16\n')
    assert only_declared.fleet_slots(0.0, learned=False) == worker_slots(16)


def test_fleet_slots_count_healthy_workers_once_all_are_known() -> None:
    pool = WorkerPool(["http://a", "http://b"])
    a, b = pool.get("http://a"), pool.get("http://b")
    assert pool.fleet_slots(0.0) is None
    a.batch_capacity = 16
    assert pool.fleet_slots(0.0) is None  # b might run hundreds
    b.batch_capacity = 4
    assert pool.fleet_slots(0.0) == worker_slots(16) + worker_slots(4) == 20 + 6
    pool.record_health("http://b", False, 0.0, "down")
    assert pool.fleet_slots(0.0) == 20  # an ejected worker takes nothing


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def _fill_and_serve_ten(admission: Admission, clock: FakeClock,
                              every_s: float = 0.125) -> None:
    """Fill 10 slots, then free and refill one every `every_s`, ten times: 10 freed within
    the 2 s rate window, 8 a second by default (9 intervals in 1.125 s)."""
    for _ in range(10):
        await admission.acquire()
    assert admission.expected_wait_s() is None  # nothing freed yet: no rate to go by
    for _ in range(10):
        clock.now += every_s
        admission.release()
        await admission.acquire()


def test_a_queue_longer_than_the_timeout_is_refused_at_once() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        admission = Admission(10, 100, 1.0, clock=clock)
        await _fill_and_serve_ten(admission, clock)
        assert admission.service_rate() == 8.0  # per second, over the span of the frees
        queued = [asyncio.create_task(admission.acquire()) for _ in range(8)]
        await _settle()
        assert admission.queued == 8  # the 8th: 8 / (8 per s) = 1 s, still within the timeout
        with pytest.raises(Saturated) as info:
            await admission.acquire()  # the 9th ahead of itself: 1.125 s > 1 s
        assert info.value.reason == "queue wait" and info.value.retry_after_s == 1
        assert admission.queued == 8 and admission.rejected == 1
        clock.now += 10.0  # the rate's window is stale: no estimate, so it queues again
        assert admission.service_rate() is None
        late = asyncio.create_task(admission.acquire())
        await _settle()
        assert admission.queued == 9
        for task in [*queued, late]:
            task.cancel()
        await asyncio.gather(*queued, late, return_exceptions=True)

    run(scenario())


def test_the_service_rate_spans_the_frees_not_the_whole_window() -> None:
    """A burst that has just filled the fleet: ten frees in the last 0.45 s are 20 a second,
    not the 5 a second that averaging over the whole 2 s window made of them, and a queue
    of 15 (0.75 s at that rate) is not refused at once."""
    async def scenario() -> None:
        clock = FakeClock()
        admission = Admission(10, 100, 1.0, clock=clock)
        await _fill_and_serve_ten(admission, clock, every_s=0.05)
        assert admission.service_rate() == pytest.approx(20.0)
        queued = [asyncio.create_task(admission.acquire()) for _ in range(15)]
        await _settle()
        assert admission.queued == 15 and admission.rejected == 0
        clock.now += 1.5  # no free since: the rate decays with the time since the first
        assert admission.service_rate() == pytest.approx(9 / 1.95)
        for task in queued:
            task.cancel()
        await asyncio.gather(*queued, return_exceptions=True)

    run(scenario())


def test_the_rate_window_stays_bounded_without_a_queue() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        admission = Admission(4, 8, 1.0, clock=clock)
        for _ in range(10_000):  # hours of traffic that never queues
            await admission.acquire()
            clock.now += 0.01
            admission.release()
        assert len(admission._freed) <= 2.0 / 0.01 + 1

    run(scenario())


def test_a_resend_queues_ahead_of_requests_younger_than_its_first_send() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        admission = Admission(1, 8, 5.0, clock=clock)
        await admission.acquire()
        order: list[str] = []

        async def waiter(name: str, since: float | None) -> None:
            await admission.acquire(since=since)
            order.append(name)

        tasks = []
        for name, since in (("new-1", None), ("new-2", None), ("resend", 90.0),
                            ("older-resend", 80.0), ("new-3", None)):
            clock.now += 1.0
            tasks.append(asyncio.create_task(waiter(name, since)))
            await _settle()
        for _ in range(5):
            admission.release()
            await _settle()
        assert order == ["older-resend", "resend", "new-1", "new-2", "new-3"]
        await asyncio.gather(*tasks)

    run(scenario())


async def _eight_queued_and_a_ninth_refused() -> tuple[Admission, list[asyncio.Task[int]]]:
    """A full fleet freeing 8 slots a second, 8 requests queued: a new one, 9 / 8 per s > 1 s
    from its slot, is refused on arrival."""
    clock = FakeClock()
    admission = Admission(10, 100, 1.0, clock=clock)
    await _fill_and_serve_ten(admission, clock)
    queued = [asyncio.create_task(admission.acquire()) for _ in range(8)]
    await _settle()
    with pytest.raises(Saturated):
        await admission.acquire()
    return admission, queued


def test_the_refusal_on_arrival_counts_only_the_requests_ahead() -> None:
    async def scenario() -> None:
        admission, queued = await _eight_queued_and_a_ninth_refused()
        senior = asyncio.create_task(admission.acquire(since=50.0))  # first sent long ago
        await _settle()
        assert admission.queued == 9 and not senior.done()
        admission.release()
        await _settle()
        assert senior.done() and not any(task.done() for task in queued)
        for task in queued:
            task.cancel()
        await asyncio.gather(*queued, return_exceptions=True)

    run(scenario())


def test_a_request_whose_retries_a_429_spends_waits_its_turn_instead() -> None:
    async def scenario() -> None:
        admission, queued = await _eight_queued_and_a_ninth_refused()
        patient = asyncio.create_task(admission.acquire(refuse_on_arrival=False))
        await _settle()
        assert admission.queued == 9 and admission.rejected == 1 and not patient.done()
        for _ in range(9):  # its turn comes
            admission.release()
        await _settle()
        assert patient.done() and patient.exception() is None
        for task in queued:
            await task

    run(scenario())


def test_a_departed_resend_leaves_the_queue_in_order() -> None:
    async def scenario() -> None:
        admission = Admission(1, 8, 5.0)
        await admission.acquire()
        tasks = {since: asyncio.create_task(admission.acquire(since=since))
                 for since in (3.0, 1.0, 2.0)}
        await _settle()
        tasks[2.0].cancel()  # the middle one leaves
        await _settle()
        assert admission.queued == 2
        admission.release()
        await _settle()
        assert tasks[1.0].done() and not tasks[3.0].done()
        admission.release()
        await _settle()
        assert tasks[3.0].done() and admission.queued == 0 and admission.in_flight == 1

    run(scenario())
