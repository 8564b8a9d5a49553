"""The request overhead of `python -m benchmarks profile --server`: what a request spends outside
steps.

A real `kvserve serve` (the profiled model and threads) is started with a kvserve gateway in front
of it, as every simulated fleet has one, and timed one request at a time on two shapes:

- short: distinct `SHORT_PROMPT_TOKENS`-token prompts, each computed whole;
- long: a `long_prefix_tokens`-token prefix shared by every prompt (cached after the first)
  plus a distinct `SUFFIX_TOKENS`-token suffix: the prefix-hit request of multi-tenant traffic,
  whose body, tokenization and prefix hashing grow with the prompt while its step stays small.

Each request asks for one output token, so the end of its stream is its first token (timed so,
the token's text may be empty). For each shape, that median TTFT minus the fitted step that
computes it is the overhead at that prompt length; the line through the two points gives the
profile's `request_overhead_ms` and `request_overhead_ms_per_prompt_token` (clamped at >= 0).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from kvserve.sim.costmodel import CostProfile, StepShape, attention_pairs

SHORT_PROMPT_TOKENS = 64
SUFFIX_TOKENS = 64
LONG_PREFIX_TOKENS = 2496
QUICK_LONG_PREFIX_TOKENS = 448
TIMED_REQUESTS = 20
WARMUP_REQUESTS = 4
BLOCK_SIZE = 16  # the server's default KV block size: a hit covers whole blocks


@dataclass(frozen=True, slots=True)
class OverheadPoint:
    """One shape: prompt tokens (BOS included), median TTFT, the fitted step, their gap."""

    name: str
    prompt_tokens: int
    ttft_ms: float
    step_ms: float

    @property
    def overhead_ms(self) -> float:
        return self.ttft_ms - self.step_ms


def fit_overhead(short: OverheadPoint, long: OverheadPoint) -> tuple[float, float]:
    """(ms, ms per prompt token) of the line through the two points, both >= 0."""
    span = long.prompt_tokens - short.prompt_tokens
    if span <= 0:
        raise ValueError("the long shape must have more prompt tokens than the short one")
    per_token = max(0.0, (long.overhead_ms - short.overhead_ms) / span)
    base = max(0.0, short.overhead_ms - per_token * short.prompt_tokens)
    return base, per_token


def measure_overhead(model_dir: Path, threads: int | None, draft: CostProfile,
                     console: Console, quick: bool = False) -> tuple[OverheadPoint, OverheadPoint]:
    """Time both shapes on a real server behind a real gateway (see the module docstring)."""
    from kvserve.bench.gateway_fleet import KvserveGateway
    from kvserve.bench.serve_load import completion_body, run_closed_loop
    from kvserve.bench.serve_prompts import PromptBuilder, PromptSpec
    from kvserve.bench.server_launch import KVSERVE, LaunchedServer, LaunchSpec
    from kvserve.model import Tokenizer

    builder = PromptBuilder(Tokenizer.from_pretrained(model_dir))
    num = TIMED_REQUESTS + WARMUP_REQUESTS
    prefix = QUICK_LONG_PREFIX_TOKENS if quick else LONG_PREFIX_TOKENS
    long_len = prefix + SUFFIX_TOKENS
    short_prompts = builder.build(PromptSpec(num, SHORT_PROMPT_TOKENS), "ovh-short")
    long_prompts = builder.build(PromptSpec(num + 1, long_len, prefix / long_len), "ovh-long")
    spec = LaunchSpec(model_dir=model_dir, served_model_name="profile", kv_cache_bytes=1 << 28,
                      max_model_len=long_len + 64, max_num_seqs=16,
                      max_num_batched_tokens=2048, num_threads=threads or 1)

    def ttfts(url: str, prompts: list[str]) -> tuple[float, int]:
        bodies = [completion_body("profile", p, 1) for p in prompts]
        records, _ = asyncio.run(run_closed_loop(url, bodies, 1, 60.0))
        timed = [r for r in records[WARMUP_REQUESTS:] if r.error is None]
        if not timed:
            errors = [r.error for r in records if r.error]
            raise RuntimeError(f"the profiling server answered no request ({errors[:1]})")
        tokens = timed[0].prompt_tokens or 0
        return statistics.median((r.end - r.start) * 1000.0 for r in timed), tokens

    with tempfile.TemporaryDirectory() as tmp, LaunchedServer(KVSERVE, spec, Path(tmp),
                                                              120.0) as server:
        gateway = KvserveGateway("prefix_hash", [server.url], Path(tmp))
        gateway.start()
        try:
            short_ms, short_tokens = ttfts(gateway.url, short_prompts)
            # The first long prompt computes the shared prefix; the rest hit it.
            long_ms, long_tokens = ttfts(gateway.url, long_prompts)
        finally:
            gateway.stop()
    short_tokens = short_tokens or SHORT_PROMPT_TOKENS + 1
    long_tokens = long_tokens or long_len + 1
    cached = min((1 + prefix) // BLOCK_SIZE * BLOCK_SIZE, long_tokens - 1)
    new = long_tokens - cached
    short = OverheadPoint("short", short_tokens, short_ms, 1000.0 * draft.step_s(
        StepShape(short_tokens, attention_pairs(0, short_tokens))))
    long = OverheadPoint("long (prefix hit)", long_tokens, long_ms, 1000.0 * draft.step_s(
        StepShape(new, attention_pairs(cached, new), prefill_context=cached)))
    for point in (short, long):
        console.print(f"server behind a gateway, {point.name}: {point.prompt_tokens}-token "
                      f"prompts, TTFT {point.ttft_ms:.1f} ms, fitted step {point.step_ms:.1f} ms: "
                      f"request overhead {point.overhead_ms:.1f} ms", highlight=False)
    return short, long
