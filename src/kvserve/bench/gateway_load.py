"""The open-loop clients of `kvserve bench gateway`, and the workers' own hit counters.

Each request is sent at its arrival time (open loop: a slow fleet does not slow the arrivals),
streaming, with the tenant in `X-Tenant-Id`. Clients behave like production ones (`ClientPolicy`):

- a 429 or 503 is backpressure: wait `retry-after-ms` or `Retry-After` (as the OpenAI
  SDKs read them; default 1 s) and send again; with `rejections_spend_retries` each one also
  counts against `max_retries`, as the OpenAI SDKs count it (their `max_retries` covers 429s,
  5xx, timeouts and connection errors alike, 2 by default), so a request refused that often
  is lost, and each attempt says the retries it follows in `x-stainless-retry-count`, as the
  SDKs do;
- a failed attempt (connection refused or reset, an error before or during the stream) is resent
  after `error_backoff_s`, at most `max_retries` times;
- with `ttft_timeout_s`, an attempt with no first token by then is abandoned (the connection is
  closed, which is all a client can do) and resent, counted against `max_retries`: the retry storm.
  Each attempt says that timeout in `x-stainless-read-timeout`, as the OpenAI SDKs send their
  read timeout (a router or worker may act on it; none has to);
- a request not done `deadline_s` after its arrival is lost.

A request that does not succeed either ended on a clean HTTP error (its last attempt was
answered with a status and a body: a 4xx/5xx, or a 429/503 past `max_retries`;
`RequestResult.final_status` says which) or is lost (no answer: the deadline passed, the
connection failed, the stream broke off).

Each request names `GatewayRequest.model` when it has one (its tenant's LoRA adapter), else the
run's model.

A kvserve gateway says on each answer how many prompt tokens its policy expected the worker to
have cached (`x-kvserve-predicted-cached-tokens`); the result keeps it beside the worker's own
`usage.prompt_tokens_details.cached_tokens`, so the prediction is checked per request.

TTFT and end-to-end latency are what the user sees: from the request's first send to the first
token (the first streamed chunk with a choice, even one whose text is still empty) / the end of
the attempt that succeeded. Where each attempt goes is the caller's `target`
(a router replica in round-robin, or the client-side ideal split).

The workers' own counters over a run are gateway_counters.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import httpx

from kvserve.bench.gateway_workload import GatewayRequest
from kvserve.client_timeout import SDK_RETRY_COUNT_HEADER, SDK_TIMEOUT_HEADER
from kvserve.wire.http import PREDICTED_CACHED_HEADER


@dataclass(frozen=True, slots=True)
class ClientPolicy:
    """How clients react to slowness and failure (see the module docstring)."""

    ttft_timeout_s: float | None = None
    max_retries: int = 3
    deadline_s: float = 120.0
    error_backoff_s: float = 0.2
    default_retry_after_s: float = 1.0
    rejections_spend_retries: bool = False


@dataclass(slots=True)
class RequestResult:
    """One logical request; times in seconds. `ok` when an attempt streamed to its end."""

    request_id: str
    tenant: str
    ok: bool = False
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None  # the worker's usage, when it reports one
    cached_tokens: int | None = None  # of those, served from its prefix cache
    predicted_cached_tokens: int | None = None  # the gateway's prediction, when it says one
    attempts: int = 0
    timeouts: int = 0
    rejections: int = 0  # 429 / 503 answers
    failures: int = 0  # other failed attempts
    error: str | None = None
    # The HTTP status a request that did not succeed ended on (a clean error, module doc);
    # None for a success or a lost request.
    final_status: int | None = None


class _Rejected(Exception):
    def __init__(self, retry_after_s: float, status: int) -> None:
        self.retry_after_s, self.status = retry_after_s, status


class _Failed(Exception):
    """A failed attempt; `status` when it was a clean HTTP error answer."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


Target = Callable[[GatewayRequest, int], str]
"""(request, attempt number from 0) -> base URL the attempt goes to."""


@dataclass(slots=True)
class _Attempt:
    ttft_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    predicted_cached_tokens: int | None = None
    first_token: asyncio.Event = field(default_factory=asyncio.Event)


def _retry_after_s(headers: httpx.Headers, default_s: float) -> float:
    """How long a 429/503 says to wait, read as the OpenAI SDKs read it: `retry-after-ms`
    first, then `Retry-After` in seconds; `default_s` when neither is a number in (0, 60]."""
    for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        try:
            wait = float(headers.get(name, "")) / scale
        except ValueError:
            continue
        if 0.0 < wait <= 60.0:
            return wait
    return default_s


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, object],
                  tenant: str, started: float, attempt: _Attempt,
                  policy: ClientPolicy, retries_taken: int) -> None:
    default_retry_after_s = policy.default_retry_after_s
    headers = {"X-Tenant-Id": tenant}
    if policy.ttft_timeout_s is not None:
        headers[SDK_TIMEOUT_HEADER] = str(float(policy.ttft_timeout_s))
    if policy.rejections_spend_retries:
        headers[SDK_RETRY_COUNT_HEADER] = str(retries_taken)
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body,
                                 headers=headers) as resp:
            if resp.status_code in (429, 503):
                await resp.aread()
                raise _Rejected(_retry_after_s(resp.headers, default_retry_after_s),
                                resp.status_code)
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise _Failed(f"HTTP {resp.status_code}: {text[:200]}", resp.status_code)
            predicted = resp.headers.get(PREDICTED_CACHED_HEADER)
            if predicted is not None:
                attempt.predicted_cached_tokens = int(predicted)
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise _Failed(f"stream error: {str(chunk['error'])[:200]}")
                usage = chunk.get("usage")
                if usage:
                    attempt.output_tokens = int(usage.get("completion_tokens") or 0)
                    attempt.prompt_tokens = usage.get("prompt_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    attempt.cached_tokens = details.get("cached_tokens")
                # The first token is the first chunk carrying a choice: its text can be
                # empty (a byte-level token that completes no character yet).
                if attempt.ttft_s is None and chunk.get("choices"):
                    attempt.ttft_s = time.perf_counter() - started
                    attempt.first_token.set()
            if not done:
                raise _Failed("stream ended without [DONE]")
    except (httpx.HTTPError, ValueError) as exc:
        raise _Failed(f"{type(exc).__name__}: {exc}") from exc


async def send_request(client: httpx.AsyncClient, request: GatewayRequest, model: str,
                       target: Target, policy: ClientPolicy) -> RequestResult:
    """Send `request` until it succeeds, runs out of retries, or passes its deadline."""
    result = RequestResult(request.request_id, request.tenant)
    body: dict[str, object] = {
        "model": request.model or model, "prompt": request.prompt,
        "max_tokens": request.max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    deadline = started + policy.deadline_s
    retries = 0
    for attempt_no in itertools.count():
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            result.error = result.error or "deadline passed"
            return result  # final_status: what the last attempt was answered, if anything
        result.attempts += 1
        attempt = _Attempt()
        task = asyncio.create_task(_stream(client, target(request, attempt_no), body,
                                           request.tenant, started, attempt, policy, retries))
        try:
            await _first_token_or_timeout(task, attempt, policy, started, remaining)
            await asyncio.wait_for(asyncio.shield(task), deadline - time.perf_counter())
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            result.final_status = None  # this attempt got no answer
            if attempt.ttft_s is None and policy.ttft_timeout_s is not None:
                result.timeouts += 1
                retries += 1
                if retries > policy.max_retries:
                    result.error = f"no first token within {policy.ttft_timeout_s} s, " \
                                   f"{policy.max_retries} retries"
                    return result
                continue
            result.error = "deadline passed"
            return result
        except _Rejected as exc:
            result.rejections += 1
            result.final_status = exc.status
            if policy.rejections_spend_retries:
                retries += 1
                if retries > policy.max_retries:
                    result.error = f"429 after {policy.max_retries} retries"
                    return result
            await asyncio.sleep(min(exc.retry_after_s, max(0.0, deadline - time.perf_counter())))
            continue
        except _Failed as exc:
            result.failures += 1
            result.error, result.final_status = str(exc), exc.status
            retries += 1
            if retries > policy.max_retries:
                return result
            await asyncio.sleep(policy.error_backoff_s)
            continue
        result.ok, result.error, result.final_status = True, None, None
        result.ttft_s = attempt.ttft_s
        result.e2e_s = time.perf_counter() - started
        result.output_tokens = attempt.output_tokens
        result.prompt_tokens, result.cached_tokens = attempt.prompt_tokens, attempt.cached_tokens
        result.predicted_cached_tokens = attempt.predicted_cached_tokens
        return result
    raise AssertionError("unreachable")


async def _first_token_or_timeout(task: asyncio.Task[None], attempt: _Attempt,
                                  policy: ClientPolicy, started: float,
                                  remaining: float) -> None:
    """Return once the attempt has its first token or has ended; TimeoutError when the TTFT
    timeout (measured from this attempt's send) or the deadline comes first. Re-raises the
    attempt's own failure."""
    limit = remaining
    if policy.ttft_timeout_s is not None:
        limit = min(limit, policy.ttft_timeout_s)
    waiter = asyncio.create_task(attempt.first_token.wait())
    try:
        done, _ = await asyncio.wait({task, waiter}, timeout=limit,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if task in done:
        task.result()  # raises _Rejected / _Failed
        return
    if not done and attempt.ttft_s is None:
        raise TimeoutError
    # else the first token arrived in the loop turn the timeout fired: the attempt goes on


@dataclass(frozen=True, slots=True)
class TimedAction:
    """Something done to the fleet `at_s` seconds into the run (a worker kill or restart);
    runs in a thread so a slow restart does not stall the clients."""

    at_s: float
    name: str
    run: Callable[[], None]


async def run_open_loop(requests: Sequence[GatewayRequest], model: str, target: Target,
                        policy: ClientPolicy, actions: Sequence[TimedAction] = (),
                        on_done: Callable[[RequestResult], None] | None = None,
                        ) -> tuple[list[RequestResult], float, list[str]]:
    """Send every request at its arrival time; the results (request order), the duration (first
    send to last completion) and the actions taken, each with its time."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(policy.deadline_s, connect=5.0)
    log: list[str] = []
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        start = time.perf_counter()

        async def one(request: GatewayRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
            result = await send_request(client, request, model, target, policy)
            if on_done is not None:
                on_done(result)
            return result

        async def act(action: TimedAction) -> None:
            await asyncio.sleep(max(0.0, start + action.at_s - time.perf_counter()))
            began = time.perf_counter() - start
            await asyncio.to_thread(action.run)
            took = time.perf_counter() - start - began
            log.append(f"{action.name} at {began:.1f} s (took {took:.1f} s)")

        jobs: list[Awaitable[object]] = [act(a) for a in actions]
        results_and_actions = await asyncio.gather(*(one(r) for r in requests), *jobs)
        duration = time.perf_counter() - start
    results = [r for r in results_and_actions if isinstance(r, RequestResult)]
    return results, duration, log
