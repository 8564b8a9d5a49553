"""The closed-loop load generator of `kvserve bench serve` and its statistics.

`concurrency` workers share one queue of prompts; each sends its next streaming
`POST /v1/completions` (greedy unless asked to sample, `ignore_eos`, exactly `max_tokens`) as
soon as its previous one ends, so at most `concurrency` requests are in flight. What is timed
(time.perf_counter, client side, so network and SSE parsing are included):

- request latency: from just before the request is sent until its stream ends;
- TTFT: from just before the request is sent to the arrival of its first chunk with non-empty text;
- ITL: the gaps between consecutive non-empty-text chunks of one request, pooled over requests;
- TPOT: per request, (latency - TTFT) / (output tokens - 1);
- duration: from just before the first request is sent until the last stream ends; request
  throughput = completed requests / duration, output tokens/s = output tokens / duration.

Output tokens are the server's `usage.completion_tokens` (`stream_options.include_usage`), else
the number of non-empty chunks. Percentiles interpolate linearly between the two nearest ranks
(numpy's default "linear" method).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvserve.percentiles import percentile as shared_percentile

MAX_ERRORS_KEPT = 3


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it; times are perf_counter seconds. `error` is None on
    success; a failed request's other fields are whatever arrived before the failure."""

    start: float
    end: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    num_chunks: int = 0  # chunks with non-empty text
    error: str | None = None


def completion_body(model: str, prompt: str, max_tokens: int, temperature: float = 0.0,
                    top_p: float = 1.0) -> dict[str, Any]:
    """Greedy unless `temperature` > 0 (then sampled, nucleus `top_p`), EOS ignored, exactly
    `max_tokens`, streamed with a final usage chunk."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": temperature, "top_p": top_p, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


async def send_one(client: httpx.AsyncClient, base_url: str, body: dict[str, Any]) -> RequestRecord:
    """Send one streaming completion and time its chunks; never raises for server errors."""
    # Invariant: `last` is the arrival time of the latest non-empty chunk, None before the first.
    record = RequestRecord(start=time.perf_counter())
    last: float | None = None
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                record.error = f"HTTP {resp.status_code}: {text[:300]}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        record.error = f"stream error: {str(chunk['error'])[:300]}"
                        break
                    usage = chunk.get("usage") or usage
                    if any(c.get("text") for c in chunk.get("choices") or ()):
                        now = time.perf_counter()
                        if last is None:
                            record.ttft_s = now - record.start
                        else:
                            record.itl_s.append(now - last)
                        last = now
                        record.num_chunks += 1
    except (httpx.HTTPError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.end = time.perf_counter()
    if usage is not None:
        record.prompt_tokens = usage.get("prompt_tokens")
        record.output_tokens = int(usage.get("completion_tokens") or 0)
    else:
        record.output_tokens = record.num_chunks
    return record


async def run_closed_loop(base_url: str, bodies: Sequence[dict[str, Any]], concurrency: int,
                          timeout_s: float) -> tuple[list[RequestRecord], float]:
    """Send every body with at most `concurrency` in flight; records in `bodies` order and the
    duration in seconds (see the module docstring)."""
    records: list[RequestRecord | None] = [None] * len(bodies)
    next_idx = iter(range(len(bodies)))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def worker(client: httpx.AsyncClient) -> None:
        for i in next_idx:  # one shared iterator: each index is taken exactly once
            records[i] = await send_one(client, base_url, bodies[i])

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        end = max((r.end for r in records if r is not None), default=start)
    return [r for r in records if r is not None], end - start


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) as in every kvserve report; NaN when empty (JSON-able)."""
    value = shared_percentile(values, p)
    return float("nan") if value is None else value


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


@dataclass(frozen=True, slots=True)
class LevelSummary:
    """One server at one concurrency: counts and latency statistics (milliseconds)."""

    concurrency: int
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    content_chunks: int  # fewer than output_tokens: tokens arrived merged, or empty, or not at all
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    tpot_ms: dict[str, float]
    errors: tuple[str, ...]

    @property
    def request_throughput(self) -> float:
        return self.completed / self.duration_s if self.duration_s > 0 else float("nan")

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else float("nan")

    @classmethod
    def from_records(cls, concurrency: int, records: Sequence[RequestRecord],
                     duration_s: float) -> LevelSummary:
        ok = [r for r in records if r.error is None]
        ttft = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
        itl = [g * 1e3 for r in ok for g in r.itl_s]
        tpot = [(r.end - r.start - r.ttft_s) * 1e3 / (r.output_tokens - 1)
                for r in ok if r.ttft_s is not None and r.output_tokens > 1]
        return cls(
            concurrency=concurrency, num_requests=len(records), completed=len(ok),
            failed=len(records) - len(ok), duration_s=duration_s,
            prompt_tokens=sum(r.prompt_tokens or 0 for r in ok),
            output_tokens=sum(r.output_tokens for r in ok),
            content_chunks=sum(r.num_chunks for r in ok),
            ttft_ms={"mean": mean(ttft), "p50": percentile(ttft, 50),
                     "p99": percentile(ttft, 99)},
            itl_ms={"mean": mean(itl), "p50": percentile(itl, 50), "p99": percentile(itl, 99)},
            tpot_ms={"mean": mean(tpot)},
            errors=tuple(dict.fromkeys(r.error for r in records if r.error))[:MAX_ERRORS_KEPT],
        )

    def as_dict(self) -> dict[str, Any]:
        return {"concurrency": self.concurrency, "num_requests": self.num_requests,
                "completed": self.completed, "failed": self.failed,
                "duration_s": self.duration_s, "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "content_chunks": self.content_chunks,
                "request_throughput": self.request_throughput,
                "output_throughput": self.output_throughput, "ttft_ms": self.ttft_ms,
                "itl_ms": self.itl_ms, "tpot_ms": self.tpot_ms, "errors": list(self.errors)}
