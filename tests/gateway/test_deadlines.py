"""The client's timeout (`kvserve.client_timeout`), the AIMD latency limit and how admission
uses both: exact states, no sockets."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvserve.client_timeout import (
    BadTimeout,
    client_timeout_s,
    format_timeout,
    refusals_spend_retries,
)
from kvserve.gateway.core.latency_limit import LatencyLimit
from kvserve.gateway.core.queue_wait import (
    ANSWER_SAMPLES,
    MIN_ANSWER_SAMPLES,
    AnswerTimes,
    max_queue_wait,
)
from kvserve.gateway.fleet.admission import Admission, Saturated


def test_the_tightest_timeout_header_wins_in_seconds() -> None:
    assert client_timeout_s({}) is None
    assert client_timeout_s({"x-kvserve-timeout": "2.5"}) == 2.5
    assert client_timeout_s({"x-stainless-read-timeout": "600.0"}) == 600.0
    assert client_timeout_s({"x-envoy-expected-rq-timeout-ms": "1500"}) == 1.5
    assert client_timeout_s({"x-stainless-read-timeout": "3", "x-kvserve-timeout": "7",
                             "x-envoy-expected-rq-timeout-ms": "4000"}) == 3.0


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "inf", ""])
def test_a_timeout_that_is_not_a_positive_number_is_refused_naming_the_header(
        value: str) -> None:
    with pytest.raises(BadTimeout, match="x-kvserve-timeout must be a positive number of "
                                         "seconds"):
        client_timeout_s({"x-kvserve-timeout": value})
    with pytest.raises(BadTimeout, match="milliseconds"):
        client_timeout_s({"x-envoy-expected-rq-timeout-ms": value})


def test_an_sdk_client_that_says_its_retries_counts_a_429_as_one() -> None:
    assert refusals_spend_retries({"x-stainless-retry-count": "0"})
    assert refusals_spend_retries({"x-stainless-retry-count": "2"})
    assert not refusals_spend_retries({"x-stainless-read-timeout": "600"})  # its timeout only
    assert not refusals_spend_retries({})


def test_the_forwarded_timeout_is_never_zero() -> None:
    assert format_timeout(1.23456) == "1.235"
    assert format_timeout(-0.5) == "0.001"


def test_a_late_answer_halves_what_was_in_flight_once_per_generation() -> None:
    limit = LatencyLimit(ceiling=256, floor=2)
    assert limit.limit == 256 and limit.generation == 0
    assert limit.on_late(0, in_flight=40)  # cut to half of what was in flight, not of 256
    assert limit.limit == 20 and limit.generation == 1
    # late answers from requests admitted before the cut say nothing about the new limit
    assert not limit.on_late(0, in_flight=40)
    assert limit.limit == 20
    assert limit.on_late(1, in_flight=20)
    assert limit.limit == 10
    for generation in range(2, 10):
        limit.on_late(generation, in_flight=10)
    assert limit.limit == 2 and limit.cuts == 10  # never below the floor


def test_answers_in_time_grow_a_limit_in_use_by_one_a_round() -> None:
    limit = LatencyLimit(ceiling=12, floor=1)
    limit.on_late(0, in_flight=20)
    assert limit.limit == 6  # half the ceiling: no more than that was admitted
    for _ in range(10):
        limit.on_time(in_flight=2)  # far below the limit: the limit is not what bounds it
    assert limit.limit == 6
    for _ in range(6):
        limit.on_time(in_flight=6)
    assert limit.limit == 6  # 6.94: one more answer makes the round
    limit.on_time(in_flight=6)
    assert limit.limit == 7
    for _ in range(100):
        limit.on_time(in_flight=12)
    assert limit.limit == 12  # the ceiling


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError):
        LatencyLimit(ceiling=4, floor=5)
    with pytest.raises(ValueError):
        LatencyLimit(ceiling=4, decrease=1.0)


def test_a_queued_request_waits_at_most_half_its_time_left() -> None:
    async def scenario() -> None:
        admission = Admission(1, 8, queue_timeout_s=5.0)
        await admission.admit()
        started = time.monotonic()
        with pytest.raises(Saturated) as refused:
            await admission.admit(deadline=started + 0.4)
        waited = time.monotonic() - started
        assert refused.value.reason == "deadline"
        assert 0.15 <= waited < 1.0, waited  # half of 0.4 s, not the 5 s queue timeout
        assert admission.in_flight == 1 and admission.queued == 0

    asyncio.run(scenario())


def test_a_client_that_says_its_timeout_waits_while_it_can_still_be_answered_in_time() -> None:
    """`queue_wait.max_queue_wait`, exactly: the queue timeout for a client that says none;
    for one that says, the queue timeout and half its time left as a floor, and more while
    the recent answer time still fits, never past `max_queue_wait_s`."""
    def wait(left: float | None, answer: float | None, cap: float = 30.0) -> tuple[float, str]:
        return max_queue_wait(left, answer, queue_timeout_s=1.0, max_queue_wait_s=cap)

    assert wait(None, 0.2) == (1.0, "queue timeout")  # says nothing: the operator's bound
    assert wait(10.0, None) == (1.0, "queue timeout")  # answers not known yet: the floor
    assert wait(1.2, None) == (0.6, "deadline")  # half its time left is below the floor
    assert wait(10.0, 2.0) == (8.0, "deadline")  # 10 s less 2 s of answer
    assert wait(3.0, 2.5) == (1.0, "queue timeout")  # slow answers: the floor, not 0.5 s
    assert wait(600.0, 0.5) == (30.0, "queue timeout")  # the SDKs' default: the cap
    assert wait(600.0, 0.5, cap=0.5) == (0.5, "queue timeout")
    assert wait(-1.0, 0.1) == (0.0, "deadline")  # already past its deadline


def test_answer_times_read_a_high_quantile_of_the_last_samples() -> None:
    times = AnswerTimes()
    for _ in range(MIN_ANSWER_SAMPLES - 1):
        times.add(0.1)
    assert times.recent_s() is None  # too few to tell
    times.add(5.0)
    assert times.recent_s() == 5.0  # one slow answer in eight is the 90th percentile
    for _ in range(ANSWER_SAMPLES):
        times.add(0.2)
    assert times.recent_s() == 0.2  # old samples are forgotten
    times.add(-1.0)
    assert times.recent_s() == 0.2


def test_a_patient_client_queues_past_the_queue_timeout_when_answers_are_quick() -> None:
    async def scenario() -> None:
        admission = Admission(1, 8, queue_timeout_s=0.05, max_queue_wait_s=5.0)
        slot = await admission.admit()
        for _ in range(MIN_ANSWER_SAMPLES):
            slot.first_byte(late=False, answer_s=0.2)
        started = time.monotonic()
        with pytest.raises(Saturated) as refused:
            await admission.admit()  # says nothing: the operator's queue timeout
        assert refused.value.reason == "queue timeout"
        assert time.monotonic() - started < 0.25
        started = time.monotonic()
        with pytest.raises(Saturated) as refused:
            await admission.admit(deadline=started + 0.8)  # may wait 0.8 - 0.2 s
        waited = time.monotonic() - started
        assert refused.value.reason == "deadline"
        assert 0.5 <= waited < 0.78, waited
        assert admission.in_flight == 1 and admission.queued == 0

    asyncio.run(scenario())


def test_a_patient_client_is_served_when_a_slot_frees_after_the_queue_timeout() -> None:
    async def scenario() -> None:
        admission = Admission(1, 8, queue_timeout_s=0.05)
        slot = await admission.admit()
        for _ in range(MIN_ANSWER_SAMPLES):
            slot.first_byte(late=False, answer_s=0.5)
        asyncio.get_running_loop().call_later(0.3, slot.release)
        await admission.admit(deadline=time.monotonic() + 10.0)
        assert admission.in_flight == 1 and admission.rejected == 0

    asyncio.run(scenario())


def test_answers_in_time_let_a_queued_request_in_through_the_slot() -> None:
    async def scenario() -> None:
        latency = LatencyLimit(ceiling=8, floor=1)
        admission = Admission(8, 8, queue_timeout_s=5.0, latency=latency)
        held = [await admission.admit() for _ in range(4)]
        held[0].first_byte(late=True)  # 4 in flight: the limit falls to 2
        held.pop().release()
        held.pop().release()
        queued = asyncio.create_task(admission.admit())
        await asyncio.sleep(0)
        assert admission.queued == 1 and not queued.done()
        for _ in range(3):  # in time, with the limit in use: 2 -> 2.5 -> 2.9 -> 3.24
            held[0].first_byte(late=False)
        await asyncio.sleep(0)
        assert queued.done() and queued.result().generation == 1 and admission.in_flight == 3

    asyncio.run(scenario())


def test_lateness_is_the_workers_time_not_the_wait_for_admission() -> None:
    from kvserve.gateway.core.lifecycle import Dispatch, Ledger
    from kvserve.gateway.core.pipeline import RoundRobinPolicy, RouteRequest

    class NoCounts(Ledger):  # lateness reads no counts
        def count_sent(self, worker_id: str) -> None: ...

        def count_ended(self, worker_id: str, finished: bool) -> None: ...

        def add_backlog(self, worker_id: str, tokens: int) -> None: ...

    def dispatch(timeout_s: float | None, ttft_target_s: float | None) -> Dispatch:
        return Dispatch(RoundRobinPolicy(), NoCounts(), RouteRequest(()), started=0.0,
                        admitted=5.0, deadline=timeout_s, ttft_target_s=ttft_target_s)

    # A 10 s client that waited 5 s for admission: the workers had 5 s, and 3/4 of that is
    # late, although 8 s after arrival is already past 3/4 of the client's timeout.
    budget = dispatch(10.0, None)
    assert not budget.is_late(8.0)
    assert budget.is_late(9.0)
    assert dispatch(10.0, 2.0).is_late(7.5)  # --ttft-target 2 s
    assert not dispatch(None, None).is_late(500.0)  # nothing said


def test_the_latency_limit_neither_bounds_nor_learns_where_it_does_not_apply() -> None:
    async def scenario() -> None:
        applies = [False]
        latency = LatencyLimit(ceiling=8, floor=1)
        admission = Admission(8, 8, queue_timeout_s=5.0, latency=latency,
                              latency_applies=lambda: applies[0])
        held = [await admission.admit() for _ in range(4)]
        held[0].first_byte(late=True)
        held[0].gave_up()
        assert latency.cuts == 0 and admission.limit == 8  # every worker declares its batch
        applies[0] = True  # a vLLM worker joined: lateness counts again
        held[0].first_byte(late=True)
        assert latency.cuts == 1 and admission.limit == 2

    asyncio.run(scenario())


def test_the_latency_limit_applies_while_some_worker_does_not_declare_its_batch() -> None:
    from kvserve.gateway.fleet.scraper import apply_metrics
    from kvserve.gateway.fleet.worker_pool import WorkerPool

    declared = 'kvserve:max_num_seqs{model_name="m"} 16\n'
    pool = WorkerPool(["http://kvserve", "http://vllm"])
    apply_metrics(pool.get("http://kvserve"), declared)
    assert not pool.all_declared(0.0)  # the vLLM worker says nothing of its batch
    pool.record_health("http://vllm", False, 0.0, "down")
    assert pool.all_declared(0.0)  # the one healthy worker declares it
    apply_metrics(pool.get("http://vllm"), declared)
    pool.record_health("http://vllm", True, 0.0, None)
    assert pool.all_declared(0.0)
    pool.record_health("http://kvserve", False, 0.0, "down")
    pool.record_health("http://vllm", False, 0.0, "down")
    assert not pool.all_declared(0.0)  # nobody healthy
