"""`kvserve epp` behind a real Envoy (run with the bootstrap `kvserve epp --print-envoy-config`
prints) in front of two real `kvserve serve` workers, with the official `openai` client: the
routes, streamed and not; one tenant on one worker and tenants apart (the salt reaching the
workers is the picker's); a saturated fleet answered 429 with Retry-After by the picker; gRPC
health; a worker killed mid-stream; no worker (503); the picker stopped (Envoy fails closed).

The tests share one fleet and run in file order: the last ones kill its workers and its picker.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.gateway.core.tenancy import Tenancy
from tests.gateway.conftest import MakeClient
from tests.gateway.epp.envoy_process import Envoy, envoy_binary, running_envoy
from tests.gateway.processes import (
    Metrics,
    Process,
    free_port,
    running_workers,
    wait_until,
)

SECRET = "epp-envoy-test-secret-0123456789"
SALT_KEY = "epp-envoy-test-salt-key"
PROMPT_LEN = 96  # six blocks of 16: a hit is at least 80 cached tokens


@dataclass
class Stack:
    workers: list[Process]
    epp: Process
    grpc_port: int
    envoy: Envoy

    def client(self, tenant: str, **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.envoy.url}/v1", api_key="unused", max_retries=0,
                             timeout=60.0, default_headers={"x-tenant-id": tenant},
                             **kwargs)  # type: ignore[arg-type]

    def finished(self) -> list[float]:
        """Each worker's finished-requests counter."""
        return [w.metrics().value("vllm:request_success_total") for w in self.workers]

    def epp_metrics(self) -> Metrics:
        return self.epp.metrics()


@pytest.fixture(scope="module")
def stack(tiny_model: Path, proc_logs: Path) -> Iterator[Stack]:
    envoy_binary()
    with running_workers(tiny_model, proc_logs, 2, ["--trusted-salt-key", SALT_KEY]) as workers:
        grpc_port = free_port()
        urls = [w.url for w in workers]
        # One request in flight at a time and none queued: a second concurrent one is refused.
        flags = ["--grpc-port", str(grpc_port), "--policy", "prefix_hash",
                 "--salt-secret", SECRET, "--trusted-salt-key", SALT_KEY,
                 "--trust-tenant-header", "--max-in-flight", "1", "--max-queued", "0"]
        epp = Process("epp", ["epp", *(a for u in urls for a in ("--worker", u)), *flags],
                      proc_logs)
        try:
            epp.wait_ready(lambda r: r.status_code == 200
                           and r.json().get("healthy_workers") == 2)
            with running_envoy(grpc_port, urls, proc_logs, flags) as envoy:
                yield Stack(workers, epp, grpc_port, envoy)
        finally:
            epp.stop()


def prompt_of(seed: str) -> list[int]:
    return random.Random(seed).choices(range(4, 300), k=PROMPT_LEN)


def test_completions_and_chat_streamed_and_not(stack: Stack, model_name: str,
                                               make_client: MakeClient) -> None:
    client = stack.client("alice")
    text = client.completions.create(model=model_name, prompt="Hello there", max_tokens=4)
    assert text.usage is not None and text.usage.completion_tokens == 4
    chunks = list(client.completions.create(model=model_name, prompt="Hello", max_tokens=4,
                                            stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=model_name, max_tokens=4,
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].finish_reason == "length"
    events = list(client.chat.completions.create(
        model=model_name, max_tokens=4, stream=True,
        messages=[{"role": "user", "content": "hi"}]))
    assert events[-1].choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list()] == [model_name]
    # Every answer ended: nothing is left counted in flight, in the picker or its admission.
    metrics = stack.epp_metrics()
    assert metrics.value("kvserve:gateway_worker_in_flight") == 0
    assert metrics.value("kvserve:gateway_requests_total") == 4


def test_one_tenant_one_worker_and_tenants_never_share(stack: Stack, model_name: str) -> None:
    prompt = prompt_of("shared document")
    before = stack.finished()
    alice = stack.client("alice")
    cached = []
    for _ in range(3):
        answer = alice.completions.create(model=model_name, prompt=prompt, max_tokens=1)
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        cached.append(answer.usage.prompt_tokens_details.cached_tokens)
    wait_until(lambda: sum(stack.finished()) == sum(before) + 3, 5.0,
               "the workers to count the requests")
    grew = [after - was for after, was in zip(stack.finished(), before, strict=True)]
    assert sorted(grew) == [0, 3], grew  # all three on one worker
    assert cached[0] == 0 and min(cached[1:]) >= 80
    holder = grew.index(3)
    # New tenants send the same prompt, every other one naming Alice's real salt: each first
    # send hits nothing, wherever it lands (the picker salts it with its own tenant's salt,
    # never the client's). Until both kinds have landed on Alice's worker.
    alice_salt = Tenancy(SECRET).salt_for("alice")
    on_holder = {"plain": 0, "forged": 0}
    for n in range(24):
        kind = ("plain", "forged")[n % 2]
        before = stack.finished()
        answer = stack.client(f"mallory-{n}").completions.create(
            model=model_name, prompt=prompt, max_tokens=1,
            extra_body={"cache_salt": alice_salt} if kind == "forged" else {})
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        assert answer.usage.prompt_tokens_details.cached_tokens == 0, (n, kind)
        wait_until(lambda before=before: sum(stack.finished()) == sum(before) + 1, 5.0,
                   "the worker to count the request")
        landed = [after - was for after, was in zip(stack.finished(), before, strict=True)]
        on_holder[kind] += landed[holder]
        if min(on_holder.values()) > 0:
            return
    raise AssertionError(f"too few new tenants were routed to Alice's worker: {on_holder}")


def test_bad_input_is_answered_by_the_picker(stack: Stack) -> None:
    bad = httpx.post(f"{stack.envoy.url}/v1/completions", content=b"{nope",
                     headers={"content-type": "application/json"}, timeout=30.0)
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "invalid_request_error"
    assert "not valid JSON" in bad.json()["error"]["message"]
    hidden = httpx.get(f"{stack.envoy.url}/debug/kv", timeout=30.0)
    assert hidden.status_code == 404  # workers' admin routes are not reachable through Envoy


def test_saturated_fleet_is_429_with_retry_after(stack: Stack, model_name: str) -> None:
    client = stack.client("carol")
    stream = client.completions.create(model=model_name, prompt="a long story", stream=True,
                                       max_tokens=120)
    next(iter(stream))  # admitted, its answer started: it holds the only slot
    with pytest.raises(openai.RateLimitError) as refused:
        client.completions.create(model=model_name, prompt="another", max_tokens=1)
    assert refused.value.response.headers["retry-after"] == "1"
    assert refused.value.body["type"] == "rate_limit_error"  # type: ignore[index]
    list(stream)
    assert stack.epp_metrics().value("kvserve:gateway_rejections_total",
                                     reason="queue full") >= 1
    answer = client.completions.create(model=model_name, prompt="another", max_tokens=1)
    assert answer.choices  # the slot came back when the stream ended


def check(grpc_port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        status: int = stub.Check(health_pb2.HealthCheckRequest(service=service),
                                 timeout=10.0).status
        return status


def test_grpc_health_services(stack: Stack) -> None:
    for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        assert check(stack.grpc_port, service) == health_pb2.HealthCheckResponse.SERVING


def test_worker_killed_mid_stream(stack: Stack, model_name: str) -> None:
    dave = stack.client("dave")
    prompt = prompt_of("dave's context")
    def served() -> list[float]:
        return [w.metrics().value("vllm:request_success_total") for w in stack.workers]

    before_placing = served()
    dave.completions.create(model=model_name, prompt=prompt, max_tokens=1)  # places it
    placed = [after - was for after, was in zip(served(), before_placing, strict=True)]
    assert sorted(placed) == [0, 1], placed
    victim = stack.workers[placed.index(1)]  # where the tenant's stream goes too
    survivor = stack.workers[placed.index(0)]
    stream = dave.completions.create(model=model_name, prompt=prompt, stream=True,
                                     max_tokens=150)
    chunks = iter(stream)
    next(chunks)
    victim_url = victim.url
    victim.kill()
    started = time.monotonic()
    # The stream breaks (or had just ended, on a fast machine): either way it ends, no hang.
    with contextlib.suppress(openai.APIError, httpx.HTTPError):
        for _ in chunks:
            pass
    assert time.monotonic() - started < 15.0
    # Sent at once, before the picker has seen the worker go: Envoy walks the fallback list.
    before = survivor.metrics().value("vllm:request_success_total")
    for _ in range(3):
        answer = dave.completions.create(model=model_name, prompt=prompt, max_tokens=1)
        assert answer.choices
    assert survivor.metrics().value("vllm:request_success_total") - before == 3
    wait_until(lambda: stack.epp.get("/health").json()["healthy_workers"] == 1, 15.0,
               "the picker to eject the killed worker")
    routed = stack.epp_metrics().value("kvserve:gateway_requests_total", worker=victim_url)
    for _ in range(2):
        dave.completions.create(model=model_name, prompt=prompt, max_tokens=1)
    assert stack.epp_metrics().value("kvserve:gateway_requests_total",
                                     worker=victim_url) == routed
    assert stack.epp_metrics().value("kvserve:gateway_worker_in_flight") == 0


def test_no_worker_is_503_and_not_ready(stack: Stack, model_name: str) -> None:
    for worker in stack.workers:
        worker.kill()
    wait_until(lambda: stack.epp.get("/health").status_code == 503, 15.0,
               "the picker to see no healthy worker")
    with pytest.raises(openai.InternalServerError) as refused:
        stack.client("erin").completions.create(model=model_name, prompt="hi", max_tokens=1)
    assert refused.value.status_code == 503
    assert refused.value.body["type"] == "service_unavailable"  # type: ignore[index]
    assert check(stack.grpc_port, "readiness") == health_pb2.HealthCheckResponse.NOT_SERVING
    assert check(stack.grpc_port, "liveness") == health_pb2.HealthCheckResponse.SERVING


def test_picker_stopped_envoy_fails_closed(stack: Stack, model_name: str) -> None:
    stack.epp.stop()
    answer = httpx.post(f"{stack.envoy.url}/v1/completions", timeout=30.0,
                        json={"model": model_name, "prompt": "hi", "max_tokens": 1})
    assert answer.status_code == 500  # failure_mode_allow: false: no unsalted request passes
