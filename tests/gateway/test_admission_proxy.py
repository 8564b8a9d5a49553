"""In overload the backlog waits at the gateway, not in a worker's queue: the gateway keeps no
more on a real kvserve worker than its batch (`kvserve:max_num_seqs`) plus headroom."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from kvserve.gateway.fleet.worker_pool import worker_slots
from tests.gateway.processes import Process, running_gateway, running_workers, wait_until

BATCH = 2
WAVE = 8


async def _stream(url: str, i: int) -> int:
    body = {"prompt": f"Backlog {i} says", "max_tokens": 220, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    chunks = 0
    async with httpx.AsyncClient(timeout=120.0) as http, \
            http.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            chunks += line.startswith("data: {")
    return chunks


def test_the_backlog_waits_at_the_gateway_not_at_the_worker(
        tiny_model: Path, proc_logs: Path) -> None:
    with running_workers(tiny_model, proc_logs, 1, ["--max-num-seqs", str(BATCH)]) as (worker,), \
            running_gateway([worker.url], proc_logs, ["--queue-timeout", "120"]) as gateway:

        def value(process: Process, name: str, **labels: str) -> float:
            return process.metrics().value(name, **labels)

        async def flood() -> list[int]:
            # The first wave fills the batch and its headroom.
            first = [asyncio.create_task(_stream(gateway.url, i)) for i in range(WAVE)]
            await asyncio.to_thread(
                wait_until, lambda: value(gateway, "kvserve:gateway_admission_limit")
                == worker_slots(BATCH), 30.0, "the gateway to know the worker's batch")
            # The second wave waits at the gateway instead of joining the worker's queue.
            second = [asyncio.create_task(_stream(gateway.url, WAVE + i)) for i in range(WAVE)]
            await asyncio.to_thread(
                wait_until, lambda: value(gateway, "kvserve:gateway_queued_requests") > 0,
                30.0, "the second wave to queue at the gateway")
            in_flight = value(gateway, "kvserve:gateway_worker_in_flight", worker=worker.url)
            assert in_flight <= WAVE, f"{in_flight} sent to a worker that runs {BATCH}"
            return await asyncio.gather(*first, *second)

        chunks = asyncio.run(flood())
        assert all(c > 0 for c in chunks), chunks  # every request served, none refused
