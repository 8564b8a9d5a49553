"""Deadlines end to end, over real sockets: a client's timeout (x-kvserve-timeout, or the
OpenAI SDKs' x-stainless-read-timeout) ends its request where it waits, on a kvserve worker
(the engine drops it, its blocks freed) and at the gateway in front of a worker that ignores
the header (the gateway closes it upstream), and the client hears a 504 instead of silence."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks.stub_worker import StubWorker
from kvserve.model import write_random_checkpoint
from tests.gateway.processes import Process, running_gateway, running_workers, wait_until
from tests.model.arch_configs import base_config

# One sequence at a time and room for a long generation: a request queued behind the blocker
# gets no first token for seconds.
SLOW_WORKER = ["--max-num-seqs", "1", "--max-model-len", "2048"]
BLOCKER = {"prompt": "A long story begins", "max_tokens": 1800, "temperature": 0.0,
           "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory,
          proc_logs: Path) -> Iterator[tuple[Process, Process]]:
    model = write_random_checkpoint(tmp_path_factory.mktemp("deadline-ckpt") / "long-llama",
                                    base_config(max_position_embeddings=4096), seed=7)
    with running_workers(model, proc_logs, 1, SLOW_WORKER) as (worker,), \
            running_gateway([worker.url], proc_logs, ["--queue-timeout", "30"]) as gateway:
        yield worker, gateway


@contextlib.contextmanager
def blocking(url: str) -> Iterator[None]:
    """A long stream holding the worker's one sequence until the block ends."""
    started, stop = threading.Event(), threading.Event()

    def run() -> None:
        with httpx.Client(timeout=120.0) as http, \
                http.stream("POST", f"{url}/v1/completions", json=BLOCKER) as response:
            for line in response.iter_lines():
                started.set()
                if stop.is_set() or line == "data: [DONE]":
                    return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(60.0), "the blocker never started streaming"
    try:
        yield
    finally:
        stop.set()
        thread.join(60.0)


def _idle(worker: Process) -> None:
    wait_until(lambda: worker.metrics().value("kvserve:kv_held_blocks") == 0
               and worker.metrics().value("kvserve:kv_live_requests") == 0, 30.0,
               "the worker to free every block")


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("header", ["x-kvserve-timeout", "x-stainless-read-timeout"])
def test_a_worker_drops_a_request_its_client_stopped_waiting_for(
        stack: tuple[Process, Process], stream: bool, header: str) -> None:
    worker, _ = stack
    with blocking(worker.url):
        sent = time.monotonic()
        response = httpx.post(f"{worker.url}/v1/completions", timeout=60.0,
                              headers={header: "0.5"},
                              json={"prompt": "Queued behind it", "max_tokens": 8,
                                    "stream": stream})
        waited = time.monotonic() - sent
    assert response.status_code == 504, response.text
    error = response.json()["error"]
    assert error["type"] == "timeout" and "timeout of 0.5 s" in error["message"]
    assert waited < 10.0, waited  # not the blocker's whole run
    _idle(worker)


def test_a_bad_timeout_is_a_400_at_the_worker_and_at_the_gateway(
        stack: tuple[Process, Process]) -> None:
    for process in stack:
        response = httpx.post(f"{process.url}/v1/completions", timeout=30.0,
                              headers={"x-kvserve-timeout": "soon"},
                              json={"prompt": "Hi", "max_tokens": 2})
        assert response.status_code == 400, response.text
        assert "x-kvserve-timeout must be a positive number of seconds" in response.text


def test_the_gateway_forwards_the_time_left_so_the_worker_drops_the_request(
        stack: tuple[Process, Process]) -> None:
    worker, gateway = stack
    with blocking(gateway.url):
        response = httpx.post(f"{gateway.url}/v1/completions", timeout=60.0,
                              headers={"x-kvserve-timeout": "1.0"},
                              json={"prompt": "Queued at the worker", "max_tokens": 8,
                                    "stream": True})
    assert response.status_code == 504, response.text
    _idle(worker)
    in_flight = gateway.metrics().value("kvserve:gateway_worker_in_flight", worker=worker.url)
    assert in_flight == 0


@pytest.fixture(scope="module")
def stub_gateway(proc_logs: Path) -> Iterator[Process]:
    """The gateway in front of a worker that ignores timeout headers and takes 30 s to its
    first token (sending a stream's headers at once, as vLLM does)."""
    with StubWorker(0, 4, 0.0, proc_logs, first_token_delay_s=30.0) as stub, \
            running_gateway([stub.url], proc_logs) as gateway:
        yield gateway


def test_the_gateway_ends_a_stream_with_no_first_token_by_the_deadline(
        stub_gateway: Process) -> None:
    sent = time.monotonic()
    with httpx.Client(timeout=60.0) as http, \
            http.stream("POST", f"{stub_gateway.url}/v1/completions",
                        headers={"x-stainless-read-timeout": "1.0"},
                        json={"prompt": "Hi", "max_tokens": 4, "stream": True}) as response:
        assert response.status_code == 200  # the worker had started the stream
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    waited = time.monotonic() - sent
    assert events[-1] == "[DONE]" and json.loads(events[0])["error"]["type"] == "timeout"
    assert 0.9 <= waited < 10.0, waited
    metrics = stub_gateway.metrics()
    assert metrics.value("kvserve:gateway_deadline_expired_total", stage="first_token") >= 1
    assert metrics.value("kvserve:gateway_worker_in_flight") == 0  # closed upstream
    assert metrics.value("kvserve:gateway_latency_limit_cuts_total") >= 1  # a late first byte


def test_the_gateway_answers_504_when_a_whole_answer_misses_the_deadline(
        stub_gateway: Process) -> None:
    sent = time.monotonic()
    response = httpx.post(f"{stub_gateway.url}/v1/completions", timeout=60.0,
                          headers={"x-envoy-expected-rq-timeout-ms": "800"},
                          json={"prompt": "Hi", "max_tokens": 4})
    assert response.status_code == 504, response.text
    assert "timeout of 0.8 s" in response.json()["error"]["message"]
    assert time.monotonic() - sent < 10.0
    assert stub_gateway.metrics().value("kvserve:gateway_deadline_expired_total",
                                        stage="response") >= 1
