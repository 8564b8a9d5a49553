"""Clients that go away: every dropped request is aborted and its blocks come back."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import httpx

from tests.server.conftest import StartServer
from tests.server.harness import ServerProcess, wait_until

NUM_REQUESTS = 200
MAX_TOKENS = 28
ABORTED = {"reason": "aborted"}


def _aborted_frees(server: ServerProcess) -> float:
    return server.metrics().value("kvserve:kv_request_frees_total", **ABORTED)


def _running(server: ServerProcess) -> float:
    return server.metrics().value("vllm:num_requests_running")


def _is_drained(server: ServerProcess) -> bool:
    m = server.metrics()
    return (m.value("kvserve:kv_held_blocks") == 0
            and m.value("vllm:num_requests_running") == 0
            and m.value("vllm:num_requests_waiting") == 0)


def _describe(server: ServerProcess) -> object:
    m = server.metrics()
    return {name: m.value(name) for name in ("kvserve:kv_held_blocks",
                                             "vllm:num_requests_running",
                                             "vllm:num_requests_waiting")}


def assert_idle_and_audited(server: ServerProcess) -> None:
    """Nothing held, nothing live, and a full audit agrees."""
    wait_until(lambda: _is_drained(server), 30.0, "the engine to drain",
               lambda: _describe(server))
    report = server.debug_kv()
    assert report["audit"]["ok"] is True, report["audit"]
    assert report["num_live_requests"] == 0, report
    assert report["held_blocks_by_request"] == {}, report
    assert report["audit"]["census"]["held"] == 0, report["audit"]


async def _one(http: httpx.AsyncClient, i: int, drop_after: int | None,
               prompt: str | list[int] | None = None) -> str:
    """Stream one request; with `drop_after`, close the response after that many chunks."""
    body = {"prompt": f"Request {i} says" if prompt is None else prompt,
            "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "stream": True}
    chunks = 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                return "done"
            if line.startswith("data: "):
                chunks += 1
                if drop_after is not None and chunks >= drop_after:
                    break  # leaving the block closes the connection mid-stream
    assert drop_after is not None, f"stream {i} ended without [DONE] after {chunks} chunks"
    return "dropped"


async def _storm(url: str) -> list[str]:
    rng = random.Random(1)
    plan = [rng.randint(1, 3) if i % 2 else None for i in range(NUM_REQUESTS)]
    limits = httpx.Limits(max_connections=NUM_REQUESTS, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=60.0, limits=limits) as http:
        return await asyncio.gather(*(_one(http, i, drop) for i, drop in enumerate(plan)))


def test_disconnect_storm_returns_every_block(server: ServerProcess) -> None:
    before = _aborted_frees(server)
    outcomes = asyncio.run(_storm(server.url))
    assert outcomes.count("done") == NUM_REQUESTS // 2
    assert outcomes.count("dropped") == NUM_REQUESTS // 2
    assert_idle_and_audited(server)
    aborted = _aborted_frees(server) - before
    # Each drop is aborted through the engine's free path (a few may finish first).
    assert aborted >= NUM_REQUESTS // 4, aborted


def test_non_streaming_disconnect_aborts_the_request(server: ServerProcess) -> None:
    before = _aborted_frees(server)
    finished_before = server.metrics().value("kvserve:kv_request_frees_total",
                                             reason="finished")
    # 64 samples of 240 tokens, 32 running at a time: seconds of work, so the drop comes first.
    body = {"prompt": ["Tell me a story", "Another one"], "n": 32, "max_tokens": 240,
            "temperature": 0.0, "ignore_eos": True}

    async def drop() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60.0) as http:
            request = asyncio.ensure_future(http.post("/v1/completions", json=body))
            # Drop once the samples run (a fixed sleep raced a slow CI machine: the client
            # went away before the server had read the body, so nothing was ever admitted).
            end = asyncio.get_running_loop().time() + 30.0
            while await asyncio.to_thread(_running, server) < 32:
                assert not request.done(), "the request finished before its samples were seen"
                assert asyncio.get_running_loop().time() < end, _describe(server)
                await asyncio.sleep(0.05)
            assert not request.done()
            request.cancel()
            await asyncio.gather(request, return_exceptions=True)

    asyncio.run(drop())
    # The 32 running samples are freed as aborted; the 32 still waiting held no blocks.
    wait_until(lambda: _aborted_frees(server) >= before + 32, 10.0,
               "the dropped request's running samples to be aborted",
               lambda: _aborted_frees(server) - before)
    assert_idle_and_audited(server)
    finished = server.metrics().value("kvserve:kv_request_frees_total", reason="finished")
    assert finished - finished_before < 64, "the dropped request ran to the end"


def _waiting(server: ServerProcess) -> float:
    return server.metrics().value("vllm:num_requests_waiting")


def test_a_stream_dropped_while_queued_leaves_the_queue_at_once(server: ServerProcess) -> None:
    """A client that gives up on its first token (a TTFT timeout) while its request waits
    behind a full batch: the request leaves the queue then, not when a slot frees, so the
    engine never computes a prompt nobody waits for."""
    body = {"prompt": "Tell me a story", "n": 32, "max_tokens": 240, "temperature": 0.0,
            "ignore_eos": True}  # the 32 running slots, for seconds

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60.0) as http:
            blocker = asyncio.ensure_future(http.post("/v1/completions", json=body))
            await _until(lambda: _running(server) >= 32, blocker, "the batch to fill")
            queued = asyncio.ensure_future(_one(http, 0, drop_after=None))
            await _until(lambda: _waiting(server) >= 1, blocker, "the stream to queue")
            queued.cancel()  # what a client's TTFT timeout does: close the connection
            await asyncio.gather(queued, return_exceptions=True)
            await _until(lambda: _waiting(server) == 0, blocker, "the dropped stream to leave")
            running = _running(server)
            assert running >= 32, f"the dropped stream left the queue only as the batch " \
                                  f"ended ({running} running): it waited for a slot"
            blocker.cancel()
            await asyncio.gather(blocker, return_exceptions=True)

    asyncio.run(scenario())
    assert_idle_and_audited(server)


async def _until(condition: Callable[[], bool], blocker: asyncio.Future[object],
                 what: str, timeout_s: float = 10.0) -> None:
    """Poll `condition` (in a thread: it scrapes) while the blocking request still runs."""
    end = asyncio.get_running_loop().time() + timeout_s
    while not await asyncio.to_thread(condition):
        assert not blocker.done(), f"the blocking request ended before {what}"
        assert asyncio.get_running_loop().time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


HOST_TIER_TENANTS = 6
HOST_TIER_REQUESTS = 120


async def _host_tier_storm(url: str) -> list[str]:
    """Tenants' 40-token prefixes (10 blocks of 4), each request with its own 2-token suffix;
    every other client drops after 1-3 chunks."""
    prefixes = [[10 + (7 * t + 13 * j) % 280 for j in range(40)] for t in range(HOST_TIER_TENANTS)]
    rng = random.Random(2)
    plan = [rng.randint(1, 3) if i % 2 else None for i in range(HOST_TIER_REQUESTS)]
    limits = httpx.Limits(max_connections=HOST_TIER_REQUESTS, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as http:
        return await asyncio.gather(*(
            _one(http, i, drop, prefixes[i % HOST_TIER_TENANTS] + [5, 6 + i % 200])
            for i, drop in enumerate(plan)))


def test_a_disconnect_storm_over_a_host_tier_returns_every_block_and_slot(
        start_server: StartServer) -> None:
    """A device pool far smaller than the tenants' prefixes: blocks go to the host tier and
    come back all the time while half the clients drop mid-stream, often with copies between
    the tiers scheduled. Afterwards nothing is held, stored half-way or pinned, and the audit
    (both tiers) is clean."""
    server = start_server(["--block-size", "4", "--num-kv-blocks", "96",
                           "--kv-host-tier-bytes", str(1 << 18), "--max-num-seqs", "16"])
    outcomes = asyncio.run(_host_tier_storm(server.url))
    assert outcomes.count("dropped") == HOST_TIER_REQUESTS // 2
    assert_idle_and_audited(server)
    m = server.metrics()
    assert m.value("kvserve:kv_host_stores_total") > 0
    assert m.value("kvserve:kv_host_loads_total") > 0
    assert m.value("kvserve:kv_host_storing_slots") == m.value("kvserve:kv_host_pinned_slots") == 0
    host = server.debug_kv()["host_tier"]["census"]
    assert host["num_storing"] == host["num_pinned"] == 0
