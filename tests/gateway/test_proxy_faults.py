"""The gateway when things go wrong, with real workers: clients that leave mid-stream, a worker
killed mid-stream, a saturated fleet, a fleet that is down."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.gateway.conftest import MakeClient
from tests.gateway.loopback import StalledWorker
from tests.gateway.processes import (
    Process,
    free_port,
    running_gateway,
    running_workers,
    wait_until,
)

RUN = {"ignore_eos": True}
CUT_SHORT = ("aborted", "disconnected")  # free reasons of a request that did not finish


def _frees(worker: Process, reasons: tuple[str, ...]) -> float:
    metrics = worker.metrics()
    return sum(metrics.value("kvserve:kv_request_frees_total", reason=r) for r in reasons)


def _held_blocks(worker: Process) -> float:
    return worker.metrics().value("kvserve:kv_held_blocks")


def _workers(gateway: Process) -> dict[str, dict[str, object]]:
    """The gateway's /workers, by URL."""
    return {w["url"]: w for w in gateway.get("/workers").json()["workers"]}


def _in_flight(gateway: Process) -> dict[str, object]:
    return {url: w["in_flight"] for url, w in _workers(gateway).items()}


def _data_events(lines: Iterator[str], count: int | None = None) -> list[str]:
    """The payloads of the next `count` SSE data events (all of them when None)."""
    events: list[str] = []
    for line in lines:
        if line.startswith("data: "):
            events.append(line.removeprefix("data: "))
            if count is not None and len(events) == count:
                break
    return events


def test_client_disconnect_mid_stream_frees_the_workers_blocks(gateway: Process,
                                                               fleet: list[Process]) -> None:
    num_streams = 6
    cut_before = sum(_frees(w, CUT_SHORT) for w in fleet)
    # Nothing slows a worker down but its own load: 200 tokens take it about a second, so the
    # streams are dropped as soon as all of them are mid-stream, with no scrape in between.
    all_mid_stream = threading.Barrier(num_streams, timeout=30)

    def stream(i: int) -> None:
        body = {"prompt": f"Stream number {i}, go on", "max_tokens": 200, "stream": True, **RUN}
        with httpx.Client(timeout=30.0) as client, \
                client.stream("POST", f"{gateway.url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert len(_data_events(response.iter_lines(), 2)) == 2
            all_mid_stream.wait()
        # Leaving the block closes the connection mid-stream: the client is gone.

    with ThreadPoolExecutor(num_streams) as pool:
        for future in [pool.submit(stream, i) for i in range(num_streams)]:
            future.result()

    def drained() -> bool:
        return all(_held_blocks(w) == 0 and w.get("/debug/kv").json()["num_live_requests"] == 0
                   for w in fleet)

    wait_until(drained, 30.0, "every worker to hold 0 blocks",
               lambda: [w.get("/debug/kv").json()["held_blocks_by_request"] for w in fleet])
    for worker in fleet:
        audit = worker.get("/debug/kv").json()["audit"]
        assert audit["ok"], audit["violations"]
    # The streams were cut short (aborted on disconnect), not run to their 200 tokens.
    assert sum(_frees(w, CUT_SHORT) for w in fleet) - cut_before == num_streams
    wait_until(lambda: set(_in_flight(gateway).values()) == {0}, 5.0,
               "the gateway's in-flight counts to return to 0", lambda: _in_flight(gateway))


@pytest.fixture
def doomed(tiny_model: Path, proc_logs: Path) -> Iterator[tuple[list[Process], Process]]:
    """Two workers of this test's own (one will be killed) and a gateway in front of them."""
    with running_workers(tiny_model, proc_logs, 2) as workers, \
            running_gateway([w.url for w in workers], proc_logs) as gateway:
        yield workers, gateway


def test_worker_killed_mid_stream_gives_a_clean_error_and_fails_over(
        doomed: tuple[list[Process], Process], make_client: MakeClient, model_name: str) -> None:
    workers, gateway = doomed
    # Token ids: 64 of them are 4 exact prefix blocks, so both streams (same tenant, same ids)
    # land on one worker, and 190 tokens of output keep them running well past the kill.
    prompt = list(range(10, 74))
    tenant = {"X-Tenant-Id": "doomed"}
    body = {"model": model_name, "prompt": prompt, "max_tokens": 190, "stream": True, **RUN}
    client = make_client(gateway.url, timeout=15.0)
    with httpx.Client(timeout=15.0) as raw_client, \
            raw_client.stream("POST", f"{gateway.url}/v1/completions", json=body,
                              headers=tenant) as raw:
        raw_lines = raw.iter_lines()
        assert len(_data_events(raw_lines, 2)) == 2
        sdk_stream = iter(client.completions.create(  # type: ignore[call-overload]
            model=model_name, prompt=prompt, max_tokens=190, stream=True, extra_body=RUN,
            extra_headers=tenant))
        next(sdk_stream), next(sdk_stream)
        in_flight = _in_flight(gateway)
        shared = [url for url, n in in_flight.items() if n == 2]
        assert len(shared) == 1, f"both streams should be on one worker: {in_flight}"
        victim_url = shared[0]
        (victim,) = [w for w in workers if w.url == victim_url]
        (survivor,) = [w for w in workers if w is not victim]
        started = time.monotonic()
        victim.kill()
        rest = _data_events(raw_lines)
        with pytest.raises(openai.APIError, match="failed mid-stream"):
            for _ in sdk_stream:
                pass
        assert time.monotonic() - started < 10.0
    # The raw stream ends with an error event (OpenAI shape), then the end marker.
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert error["type"] == "upstream_error" and victim_url in error["message"]

    # New requests fail over to the survivor at once, whatever their prefix's first choice.
    started = time.monotonic()
    for i in range(6):
        answer = client.completions.create(model=model_name, prompt=[*prompt[:60], i] * 2,
                                           max_tokens=4, extra_body=RUN,
                                           extra_headers={"X-Tenant-Id": f"t{i}"})
        assert answer.usage is not None and answer.usage.completion_tokens == 4
    assert time.monotonic() - started < 10.0
    assert _workers(gateway)[survivor.url]["requests"] >= 6
    wait_until(lambda: not _workers(gateway)[victim_url]["healthy"], 5.0,
               "the gateway to mark the killed worker unhealthy", lambda: _workers(gateway))
    health = gateway.get("/health")
    assert health.status_code == 200 and health.json()["healthy_workers"] == 1


# One request in flight fleet-wide; the rest are refused at once, or after 50 ms in the queue.
SATURATION = {
    "queue full": ["--max-in-flight", "1", "--max-queued", "0"],
    "queue timeout": ["--max-in-flight", "1", "--max-queued", "8", "--queue-timeout", "0.05"],
}


@pytest.mark.parametrize("reason", SATURATION, ids=lambda r: r.replace(" ", "-"))
def test_saturated_fleet_answers_429_with_retry_after(fleet: list[Process], proc_logs: Path,
                                                      make_client: MakeClient, model_name: str,
                                                      reason: str) -> None:
    num_requests = 6
    start_together = threading.Barrier(num_requests, timeout=30)
    with running_gateway([w.url for w in fleet], proc_logs, SATURATION[reason]) as gateway:
        client = make_client(gateway.url)

        def slow_request(i: int) -> object:
            start_together.wait()
            try:
                return client.completions.create(model=model_name, prompt=f"Flood {i}",
                                                  max_tokens=100, extra_body=RUN)
            except openai.RateLimitError as exc:
                return exc

        with ThreadPoolExecutor(num_requests) as pool:
            results = list(pool.map(slow_request, range(num_requests)))
        rejected = [r for r in results if isinstance(r, openai.RateLimitError)]
        served = [r for r in results if not isinstance(r, openai.RateLimitError)]
        assert rejected and served, results
        for exc in rejected:
            assert exc.status_code == 429
            assert int(exc.response.headers["retry-after"]) >= 1
            assert exc.response.json()["error"]["type"] == "rate_limit_error"
        assert gateway.metrics().value("kvserve:gateway_rejections_total",
                                       reason=reason) == len(rejected)
        # Saturation passes: the freed slot serves the next request.
        answer = client.completions.create(model=model_name, prompt="After the flood",
                                           max_tokens=2, extra_body=RUN)
        assert answer.usage is not None and answer.usage.completion_tokens == 2


def test_health_is_503_and_requests_fail_cleanly_when_every_worker_is_down(
        proc_logs: Path, make_client: MakeClient) -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    with running_gateway([nobody], proc_logs, expect_healthy=0) as gateway:
        health = gateway.get("/health")
        assert health.status_code == 503 and health.json()["healthy_workers"] == 0
        answer = httpx.post(f"{gateway.url}/v1/completions", timeout=30.0,
                            json={"prompt": "anyone there?", "max_tokens": 2})
        assert answer.status_code == 503 and answer.headers["retry-after"]
        assert set(answer.json()["error"]) == {"message", "type", "param", "code"}


def test_a_client_that_gives_up_before_the_first_token_cancels_the_upstream_request(
        proc_logs: Path) -> None:
    """A client that times out while its request waits at the worker (queued, or in prefill)
    must not leave it there: a retry storm would have the worker compute every abandoned
    prompt. The gateway closes the upstream connection, which a worker sees as an abort."""
    # One admission slot: each request after the first gets it only if the one before gave
    # it back (else it waits out the queue timeout and is answered 429).
    flags = ["--max-in-flight", "1", "--queue-timeout", "0.5"]
    with StalledWorker() as worker, running_gateway([worker.url], proc_logs, flags) as gateway:
        for stream in (True, False, True):
            posts = worker.posts
            body = {"prompt": "hello", "max_tokens": 4, "stream": stream}
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=1.0)
            gave_up = time.monotonic()
            assert worker.posts == posts + 1  # it reached the worker, which never answered
            wait_until(lambda: len(worker.closed_at) == worker.posts, 5.0,
                       "the gateway to close the upstream request")
            assert worker.closed_at[-1] - gave_up < 5.0
            wait_until(lambda: set(_in_flight(gateway).values()) == {0}, 5.0,
                       "the gateway's in-flight count to return to 0",
                       lambda: _in_flight(gateway))


def test_a_proxied_route_takes_only_post(gateway: Process) -> None:
    answer = httpx.get(f"{gateway.url}/v1/completions", timeout=10.0)
    assert answer.status_code == 405 and answer.headers["allow"] == "POST"
    assert "takes POST" in answer.json()["error"]["message"]
