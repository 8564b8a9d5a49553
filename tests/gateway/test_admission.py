"""Admission: first come first served, a limit that follows the fleet's learned capacity, and
no slot lost to a request that times out or leaves while queued."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.gateway.fleet.admission import Admission, Saturated
from kvserve.gateway.fleet.scraper import apply_metrics
from kvserve.gateway.fleet.worker_pool import WorkerPool, WorkerState, worker_slots


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_queued_requests_get_slots_in_arrival_order() -> None:
    async def scenario() -> None:
        admission = Admission(1, 8, 5.0)
        held = [await admission.admit()]
        order: list[int] = []

        async def waiter(i: int) -> None:
            held.append(await admission.admit())
            order.append(i)

        tasks = [asyncio.create_task(waiter(i)) for i in range(4)]
        await _settle()
        assert admission.queued == 4 and admission.in_flight == 1
        for _ in range(4):
            held.pop(0).release()
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
        held = [await admission.admit() for _ in range(3)]
        slots[0] = 2  # the workers were seen full: three in flight is already over
        assert admission.limit == 2
        late = asyncio.create_task(admission.admit())
        await _settle()
        assert not late.done() and admission.queued == 1
        held.pop().release()
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
        first = await admission.admit()
        with pytest.raises(Saturated) as info:
            await admission.admit()
        assert info.value.reason == "queue timeout" and admission.rejected == 1
        assert admission.queued == 0
        gone = asyncio.create_task(admission.admit())
        nxt = asyncio.create_task(admission.admit())
        await _settle()
        gone.cancel()  # the client left while queued
        await asyncio.gather(gone, return_exceptions=True)
        first.release()
        await _settle()
        assert nxt.done() and admission.in_flight == 1 and admission.queued == 0

    run(scenario())


def test_a_slot_handed_over_as_its_waiter_leaves_is_passed_on() -> None:
    async def scenario() -> None:
        admission = Admission(1, 8, 5.0)
        held = await admission.admit()
        first = asyncio.create_task(admission.admit())
        second = asyncio.create_task(admission.admit())
        await _settle()
        held.release()  # hands the slot to `first`...
        first.cancel()  # ...which is cancelled before it runs again
        await asyncio.gather(first, return_exceptions=True)
        await _settle()
        assert second.done() and admission.in_flight == 1

    run(scenario())


def test_a_slot_is_released_once_however_often_its_holder_lets_go() -> None:
    async def scenario() -> None:
        admission = Admission(2, 8, 5.0)
        with await admission.admit() as slot:
            other = await admission.admit()
            slot.release()  # an early release, then the block's end: one slot freed
        assert admission.in_flight == 1 and slot.released
        other.release()
        other.release()
        assert admission.in_flight == 0

    run(scenario())


def test_a_full_queue_rejects_at_once() -> None:
    async def scenario() -> None:
        admission = Admission(1, 0, 5.0)
        await admission.admit()
        with pytest.raises(Saturated) as info:
            await admission.admit()
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
