"""Admission and lifecycle over HTTP: 429 + Retry-After when saturated, graceful shutdown."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.server.conftest import StartServer
from tests.server.harness import ServerProcess, wait_until

LONG = {"prompt": "Tell me everything", "max_tokens": 200, "temperature": 0.0,
        "ignore_eos": True}
SHORT = {"prompt": "Hi", "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
HOLD = {**LONG, "max_tokens": 240, "n": 4}  # seconds of work on one sequence slot
DRAIN_TIMEOUT_S = 5


@pytest.fixture(scope="module")
def saturated(start_server: StartServer) -> ServerProcess:
    """Room for exactly one request: one running, none waiting."""
    return start_server(["--max-num-seqs", "1", "--max-waiting-requests", "0"])


def _running(server: ServerProcess) -> float:
    return server.metrics().value("vllm:num_requests_running")


def _assert_429(response: httpx.Response) -> None:
    assert response.status_code == 429, response.text
    assert int(response.headers["retry-after"]) >= 1
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "rate_limit_error" and "saturated" in error["message"]


def test_health_is_ok(server: ServerProcess) -> None:
    response = httpx.get(f"{server.url}/health", timeout=10.0)
    assert response.status_code == 200 and response.json() == {"status": "ok", "role": "both"}


def _rejected(server: ServerProcess) -> float:
    try:
        return server.metrics().value("kvserve:requests_rejected_total", cause="queue_full")
    except KeyError:  # no rejection yet
        return 0.0


def _wait_idle(server: ServerProcess) -> None:
    # The engine may drain a moment before the HTTP handler gives its admission slot back: the
    # next test's requests would find the server still saturated.
    def idle() -> bool:
        m = server.metrics()
        return (m.value("vllm:num_requests_running") == 0
                and m.value("kvserve:kv_held_blocks") == 0
                and m.value("kvserve:requests_in_flight") == 0)
    wait_until(idle, 30.0, "the dropped request to be aborted")


async def _flood(url: str, body: dict[str, object], num: int) -> tuple[list[httpx.Response], int]:
    """Send `num` requests at once; return the answers that came back while exactly one was
    still running (then drop that one), and how many were still running."""
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as http:
        pending = {asyncio.ensure_future(http.post("/v1/completions", json=body))
                   for _ in range(num)}
        answered: list[httpx.Response] = []
        while len(pending) > 1:
            done, pending = await asyncio.wait(pending, timeout=30.0,
                                               return_when=asyncio.FIRST_COMPLETED)
            if not done:
                break
            answered += [task.result() for task in done]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return answered, len(pending)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_flood_admits_one_and_refuses_the_rest(saturated: ServerProcess, stream: bool) -> None:
    """Twelve requests at once on room for one: eleven get 429 + Retry-After at once while
    the admitted one runs (for seconds: four samples one after another)."""
    rejected_before = _rejected(saturated)
    assert saturated.metrics().value("kvserve:requests_in_flight") == 0
    answered, running = asyncio.run(_flood(saturated.url, {**HOLD, "stream": stream}, 12))
    assert running == 1, [r.status_code for r in answered]
    assert [r.status_code for r in answered] == [429] * 11
    for response in answered:
        _assert_429(response)
    assert _rejected(saturated) - rejected_before == 11
    _wait_idle(saturated)


def test_busy_server_refuses_every_newcomer_then_recovers(saturated: ServerProcess) -> None:
    """While one request runs, every other one is a 429 (streaming, chat, the openai client);
    once it is gone, a request is served again."""
    with httpx.stream("POST", f"{saturated.url}/v1/completions", json={**HOLD, "stream": True},
                      timeout=60.0) as holder:
        assert holder.status_code == 200
        lines = holder.iter_lines()  # kept: dropping the iterator would close the connection
        assert next(lines).startswith("data: ")  # it runs
        with httpx.Client(base_url=saturated.url, timeout=60.0) as http:
            _assert_429(http.post("/v1/completions", json=SHORT))
            _assert_429(http.post("/v1/completions", json={**SHORT, "stream": True}))
            _assert_429(http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}))
        client = openai.OpenAI(base_url=f"{saturated.url}/v1", api_key="dummy", max_retries=0)
        with pytest.raises(openai.RateLimitError) as excinfo:
            client.completions.create(model=None, prompt="Hi", max_tokens=4)  # type: ignore[arg-type]
        assert excinfo.value.response.headers["retry-after"]
        assert httpx.get(f"{saturated.url}/health", timeout=10.0).status_code == 200
    _wait_idle(saturated)  # leaving the block dropped the holder: it is aborted
    response = httpx.post(f"{saturated.url}/v1/completions", json=SHORT, timeout=60.0)
    assert response.status_code == 200, response.text


def test_sigint_drains_in_flight_requests_and_exits_zero(start_server: StartServer) -> None:
    server = start_server(["--drain-timeout", str(DRAIN_TIMEOUT_S)])
    results: dict[str, object] = {}

    def whole() -> None:
        results["whole"] = httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=60.0)

    def streamed() -> None:
        lines = []
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True},
                          timeout=60.0) as response:
            lines = [line for line in response.iter_lines() if line]
        results["stream"] = lines

    threads = [threading.Thread(target=whole), threading.Thread(target=streamed)]
    for thread in threads:
        thread.start()
    wait_until(lambda: _running(server) == 2, 30.0, "both requests to run")
    start = time.monotonic()
    server.proc.send_signal(signal.SIGINT)
    returncode = server.proc.wait(DRAIN_TIMEOUT_S + 30)
    elapsed = time.monotonic() - start
    for thread in threads:
        thread.join(10.0)
    assert returncode == 0, server.log()
    assert elapsed < DRAIN_TIMEOUT_S + 5, elapsed

    # In flight at SIGINT: both completed (the drain let them finish).
    whole_response = results["whole"]
    assert isinstance(whole_response, httpx.Response)
    assert whole_response.status_code == 200, whole_response.text
    body = whole_response.json()
    assert body["usage"]["completion_tokens"] == LONG["max_tokens"]
    assert body["choices"][0]["finish_reason"] == "length"
    lines = results["stream"]
    assert isinstance(lines, list) and lines[-1] == "data: [DONE]", lines[-3:]
    finals = [json.loads(line[6:])["choices"][0]["finish_reason"]
              for line in lines[:-1] if '"finish_reason":"length"' in line]
    assert finals == ["length"]
    assert "Traceback" not in server.log(), server.log()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=2.0)
