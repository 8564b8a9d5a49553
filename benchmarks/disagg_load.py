"""The load of `python -m benchmarks disagg`: ongoing decodes interrupted by periodic long prompts.

`num_decoders` clients each stream one request after another (a short prompt, a long output,
EOS ignored) for `duration_s`; the gap between consecutive tokens of a stream is one ITL sample.
Every `long_every_s` a long prompt (never seen before: no prefix-cache hit) is sent with a short
output; its time to first token is one TTFT sample. Prompts are token ids drawn from a seeded
RNG, so both fleets get exactly the same requests.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from dataclasses import dataclass, field

import httpx

FIRST_ORDINARY_TOKEN = 4  # the demo tokenizer's special tokens sit below


@dataclass(frozen=True, slots=True)
class MixSpec:
    """Sizes of the mix (CLI flags)."""

    num_decoders: int = 4
    decode_prompt_len: int = 32
    decode_output_len: int = 128
    long_prompt_len: int = 2048
    long_output_len: int = 4
    long_every_s: float = 1.0
    duration_s: float = 20.0
    vocab_size: int = 512
    seed: int = 0

    def check(self) -> None:
        if min(self.num_decoders, self.decode_prompt_len, self.decode_output_len,
               self.long_prompt_len, self.long_output_len) < 1:
            raise ValueError("decoders, prompt and output lengths must be at least 1")
        if self.long_every_s <= 0 or self.duration_s <= 0:
            raise ValueError("--long-every and --duration must be positive")


@dataclass(slots=True)
class MixResult:
    """What the mix measured: ITL samples of the decodes, TTFT samples of the long prompts."""

    itl_s: list[float] = field(default_factory=list)
    long_ttft_s: list[float] = field(default_factory=list)
    num_decode_tokens: int = 0
    num_failed: int = 0
    wall_s: float = 0.0


def _prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ORDINARY_TOKEN, vocab) for _ in range(length)]


async def _stream(http: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                  max_tokens: int) -> list[float]:
    """Arrival time of every token of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    times = []
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk["choices"] and chunk["choices"][0].get("text") is not None:
                times.append(time.perf_counter())
    return times


async def run_mix(url: str, model: str, spec: MixSpec, seed_tag: str = "") -> MixResult:
    """Run the mix against `url` (a gateway) and return its samples."""
    result = MixResult()
    deadline = time.perf_counter() + spec.duration_s
    limits = httpx.Limits(max_connections=spec.num_decoders + 64)
    async with httpx.AsyncClient(timeout=600.0, limits=limits) as http:

        async def decoder(idx: int) -> None:
            rng = random.Random(f"{spec.seed}-{seed_tag}-decoder-{idx}")
            while time.perf_counter() < deadline:
                prompt = _prompt(rng, spec.decode_prompt_len, spec.vocab_size)
                try:
                    times = await _stream(http, url, model, prompt, spec.decode_output_len)
                except (httpx.HTTPError, RuntimeError):
                    result.num_failed += 1
                    continue
                result.itl_s.extend(b - a for a, b in itertools.pairwise(times))
                result.num_decode_tokens += len(times)

        async def long_prompt(rng: random.Random) -> None:
            prompt = _prompt(rng, spec.long_prompt_len, spec.vocab_size)
            started = time.perf_counter()
            try:
                times = await _stream(http, url, model, prompt, spec.long_output_len)
            except (httpx.HTTPError, RuntimeError):
                result.num_failed += 1
                return
            if times:
                result.long_ttft_s.append(times[0] - started)

        async def longs() -> None:
            rng = random.Random(f"{spec.seed}-{seed_tag}-long")
            tasks = []
            await asyncio.sleep(spec.long_every_s / 2)
            while time.perf_counter() < deadline:
                tasks.append(asyncio.ensure_future(long_prompt(rng)))
                await asyncio.sleep(spec.long_every_s)
            await asyncio.gather(*tasks)

        started = time.perf_counter()
        await asyncio.gather(*(decoder(i) for i in range(spec.num_decoders)), longs())
        result.wall_s = time.perf_counter() - started
    return result

