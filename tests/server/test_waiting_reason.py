"""`vllm:num_requests_waiting_by_reason` on a live worker whose KV cache holds one request at a
time: the queue shows as `capacity`. `deferred` (waiting to hit blocks another request writes
in a later step) stays 0: a prefill chunk takes the whole step budget, so a waiting request is
looked at only in a step where every running prefill finishes, and it then shares those blocks
in flight instead of waiting (docs/operations.md, "Metrics")."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.server.conftest import StartServer
from tests.server.harness import Metrics

NAME = "vllm:num_requests_waiting_by_reason"


def test_requests_the_cache_cannot_hold_wait_for_capacity_not_deferred(
        start_server: StartServer) -> None:
    # 24 blocks of 16 tokens: one 190-token prompt and its output fit, two do not.
    server = start_server(["--num-kv-blocks", "24", "--max-num-batched-tokens", "64"])
    model = httpx.get(f"{server.url}/v1/models", timeout=10.0).json()["data"][0]["id"]
    seen: list[Metrics] = []

    def send(i: int, n: int) -> None:
        body = {"model": model, "prompt": [i, *range(20, 209)], "max_tokens": 16, "n": n,
                "ignore_eos": True}
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).raise_for_status()

    with ThreadPoolExecutor(4) as pool, httpx.Client(timeout=10.0) as client:
        sent = [pool.submit(send, i, 2 if i == 0 else 1) for i in range(4)]  # one n=2 pair
        while not all(f.done() for f in sent):
            seen.append(Metrics(client.get(f"{server.url}/metrics").text))
        for future in sent:
            future.result()
    queued = [m for m in seen if m.value(NAME, reason="capacity") > 0]
    assert queued, f"no scrape of {len(seen)} saw a request waiting"
    for m in seen:  # the reasons split the queue, and nothing waited as deferred
        assert m.value(NAME, reason="deferred") == 0
        assert m.value(NAME, reason="capacity") == m.value("vllm:num_requests_waiting")
