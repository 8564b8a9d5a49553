"""Seeing other routers on the workers: the foreign count is a lower bound that the gateway's own
traffic never raises, the verdict turns on and off only on evidence, and the scraper feeds it
from real scrapes (a worker reporting more requests running, or finishing more, than the gateway
sent it)."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.gateway.fleet.foreign_load import DEFAULT_MIN_FOREIGN, DEFAULT_WINDOW_S, ForeignLoad
from kvserve.gateway.fleet.scraper import Scraper
from kvserve.gateway.fleet.upstream_http import UpstreamClient
from kvserve.gateway.fleet.worker_pool import WorkerPool
from tests.gateway.loopback import loopback_workers


def test_the_gateways_own_requests_are_never_foreign() -> None:
    load = ForeignLoad(window_s=60.0, min_share=0.2, min_foreign=4)
    # The worker reports fewer than the gateway has there (in transit, finishing): 0, not < 0.
    assert load.record(0.0, reported=3, own_at_most=5) == 0
    assert load.record(1.0, reported=5, own_at_most=5) == 0
    for t in range(2, 100):
        load.record(float(t), reported=4, own_at_most=4)
    assert load.share == 0.0 and not load.shared


def test_two_replicas_are_seen_and_forgotten_on_evidence() -> None:
    load = ForeignLoad(window_s=10.0, min_share=0.2, min_foreign=4)
    # Another replica's two requests alongside this gateway's two: half the load is foreign.
    assert load.record(0.0, reported=4, own_at_most=2) == 2
    assert not load.shared  # 2 foreign requests: not yet evidence
    load.record(1.0, reported=4, own_at_most=2)
    assert load.shared and load.share == pytest.approx(0.5)
    for t in range(2, 30):  # an idle fleet changes nothing
        load.record(float(t), reported=0, own_at_most=0)
    assert load.shared
    load.record(30.0, reported=2, own_at_most=2)  # alone again; the old samples are gone
    assert load.share == 0.0 and load.shared  # 2 requests seen: not yet evidence
    load.record(31.0, reported=2, own_at_most=2)
    assert not load.shared


def test_a_trickle_of_foreign_requests_is_not_a_replica() -> None:
    load = ForeignLoad(window_s=60.0, min_share=0.2, min_foreign=4)
    for t in range(60):  # a health prober's request now and then, on a busy worker
        load.record(float(t), reported=10 + (t % 10 == 0), own_at_most=10)
    assert load.share < 0.02 and not load.shared


def test_finished_requests_see_a_replica_that_short_requests_hide_from_the_running_count(
) -> None:
    load = ForeignLoad(window_s=60.0, min_share=0.2, min_foreign=4)
    for t in range(10):  # light load: every scrape finds the worker idle
        assert load.record(float(t), reported=0, own_at_most=0) == 0
        # ... but it finished 2 requests since the last scrape, and this gateway sent 1
        assert load.record_finished(float(t), finished=2, own_at_most=1) == 1
    assert load.shared and load.share == pytest.approx(0.5)


def test_finished_requests_of_the_gateways_own_are_never_foreign() -> None:
    load = ForeignLoad(window_s=60.0, min_share=0.2, min_foreign=4)
    for t in range(100):  # what was in flight at the last scrape, or sent since, finishing
        assert load.record_finished(float(t), finished=t % 5, own_at_most=4) == 0
    assert load.share == 0.0 and not load.shared


def test_a_restart_under_load_is_a_verdict_for_at_most_one_window() -> None:
    # A gateway restarted while its previous process had requests on the workers sees them as
    # foreign until they end. Fewer than DEFAULT_MIN_FOREIGN never turn the verdict on; more
    # do, and the window (the defaults) ends it once it holds only this gateway's requests.
    few = ForeignLoad()
    few.record(0.0, reported=DEFAULT_MIN_FOREIGN - 1, own_at_most=0)
    for t in range(1, 200):
        few.record(float(t), reported=4, own_at_most=4)
        assert not few.shared
    many = ForeignLoad()
    many.record(0.0, reported=40, own_at_most=0)
    many.record(1.0, reported=20, own_at_most=0)  # the leftovers ending
    assert many.shared
    t = 2
    while many.shared:
        many.record(float(t), reported=4, own_at_most=4)
        t += 1
    assert t - 1 <= 1 + DEFAULT_WINDOW_S + 1  # 60 leftovers outweigh a minute of own traffic


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="min_share"):
        ForeignLoad(min_share=0.0)
    with pytest.raises(ValueError, match="window_s"):
        ForeignLoad(window_s=0.0)


def test_the_scraper_sees_requests_the_gateway_did_not_send() -> None:
    asyncio.run(_scrape_shared_workers())


async def _scrape_shared_workers() -> None:
    running: dict[str, int] = {}

    def answer(url: str, path: str) -> tuple[int, str]:
        if path == "/health":
            return 200, "ok"
        return 200, (f"vllm:num_requests_running {running[url]}\n"
                     "vllm:num_requests_waiting 1\n")

    verdicts: list[bool] = []
    client = UpstreamClient()
    async with loopback_workers(2, answer) as (a, b):
        pool = WorkerPool([a, b])
        pool.get(a).in_flight = 3  # this gateway's own: 3 on a, none on b
        running.update({a: 2, b: 3})  # a: 2 + 1 waiting, all ours; b: 4, none ours
        foreign = ForeignLoad(min_foreign=4)
        scraper = Scraper(pool, client, foreign=foreign, on_shared=verdicts.append)
        await scraper.scrape_once()
        assert (pool.get(a).foreign, pool.get(b).foreign) == (0, 4)
        assert verdicts == [True] and foreign.share == pytest.approx(4 / 7)
        await client.aclose()


def test_the_scraper_counts_finished_requests_the_gateway_did_not_send() -> None:
    asyncio.run(_scrape_finished_requests())


async def _scrape_finished_requests() -> None:
    finished = {"stop": 10, "length": 5}

    def answer(url: str, path: str) -> tuple[int, str]:
        if path == "/health":
            return 200, "ok"
        return 200, ("vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
                     "vllm:prefix_cache_queries_total 100\n" + "".join(
                         f'vllm:request_success_total{{finished_reason="{reason}"}} {n}\n'
                         f'vllm:request_success_created{{finished_reason="{reason}"}} 1.7e9\n'
                         for reason, n in finished.items()))

    client = UpstreamClient()
    async with loopback_workers(1, answer) as (a,):
        pool = WorkerPool([a])
        worker = pool.get(a)
        worker.in_flight = 1  # this gateway's own, open when the first scrape goes out
        foreign = ForeignLoad(min_foreign=4)
        scraper = Scraper(pool, client, foreign=foreign)
        await scraper.scrape_once()  # the first sighting: no interval to judge yet
        assert worker.requests_finished == 15 and worker.foreign == 0
        worker.dispatched += 2  # it sends two more; 8 requests finish in all
        finished["stop"] += 8
        await scraper.scrape_once()
        assert worker.foreign == 5 and foreign.shared  # 8 - (1 open + 2 sent)
        assert foreign.share == pytest.approx(5 / 8)
        finished.update(stop=1, length=0)  # restarted: the counter began again
        await scraper.scrape_once()
        assert worker.foreign == 0 and worker.requests_finished == 1
        finished["stop"] += 3  # from the new start, all three its own
        worker.dispatched += 3
        await scraper.scrape_once()
        assert worker.foreign == 0
        worker.in_flight, worker.abandoned = 0, 2  # its client left: the gateway let go of it
        await scraper.scrape_once()  # ... of two, which the worker has not noticed yet
        finished["length"] += 2  # it counts them a scrape later: still the gateway's own
        await scraper.scrape_once()
        assert worker.foreign == 0
        await client.aclose()
