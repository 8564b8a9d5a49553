"""Over real sockets: a client's resend of a request not yet answered queues at the gateway in
the place its first send took, ahead of requests that arrived after that first send, and the
gateway counts it (`kvserve:gateway_resends_total`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks.stub_worker import StubWorker
from tests.gateway.processes import Process, running_gateway, wait_until

DELAY_S = 3.0  # the stub's time to an answer: one request at a time, so one every DELAY_S


@pytest.fixture(params=["--seniority", "--no-seniority"])
def stack(request: pytest.FixtureRequest, proc_logs: Path) -> Iterator[tuple[Process, bool]]:
    """The gateway, one slot wide, in front of a stub worker; and whether seniority is on."""
    with StubWorker(0, 1, 0.0, proc_logs, first_token_delay_s=DELAY_S) as stub, \
            running_gateway([stub.url], proc_logs, ["--max-in-flight", "1", "--queue-timeout",
                                                    "30", request.param]) as gateway:
        yield gateway, request.param == "--seniority"


def test_a_resend_is_served_before_requests_younger_than_its_first_send(
        stack: tuple[Process, bool]) -> None:
    gateway, seniority = stack

    def queued() -> float:
        return gateway.metrics().value("kvserve:gateway_queued_requests")

    async def scenario() -> list[str]:
        done: list[str] = []
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60.0) as http:

            async def ask(name: str) -> None:
                response = await http.post("/v1/completions",
                                           json={"prompt": name, "max_tokens": 1})
                assert response.status_code == 200, response.text
                done.append(name)

            async def until_queued(count: int) -> None:
                await asyncio.to_thread(wait_until, lambda: queued() == count, 30.0,
                                        f"{count} queued at the gateway")

            running = asyncio.create_task(ask("holds the only slot"))
            await asyncio.to_thread(
                wait_until, lambda: gateway.metrics().value("kvserve:gateway_worker_in_flight")
                == 1, 30.0, "the first request to take the slot")
            first_send = asyncio.create_task(ask("resent"))
            await until_queued(1)
            first_send.cancel()  # its client gives up while it waits, and will send it again
            await asyncio.gather(first_send, return_exceptions=True)
            await until_queued(0)
            younger = []
            for i in range(2):  # one after the other, so their order is known
                younger.append(asyncio.create_task(ask(f"younger {i}")))
                await until_queued(i + 1)
            resend = asyncio.create_task(ask("resent"))
            await until_queued(3)
            await asyncio.gather(running, *younger, resend)
        return done

    sent = time.monotonic()
    done = asyncio.run(scenario())
    assert time.monotonic() - sent < 30.0
    if seniority:
        assert done == ["holds the only slot", "resent", "younger 0", "younger 1"], done
        assert gateway.metrics().value("kvserve:gateway_resends_total") == 1
    else:  # --no-seniority: by arrival, as before
        assert done == ["holds the only slot", "younger 0", "younger 1", "resent"], done
        assert gateway.metrics().value("kvserve:gateway_resends_total") == 0
