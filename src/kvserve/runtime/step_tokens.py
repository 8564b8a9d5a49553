"""Tokens computed per engine step, counted into fixed buckets on the engine's thread: the
distribution behind vLLM's `vllm:iteration_tokens_total` histogram (batch fill, prefill vs
decode mix). A snapshot is a few integers, cheap enough to take every step."""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's bucket bounds for iteration_tokens_total, so the two kinds of worker aggregate together
STEP_TOKEN_BOUNDS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True, slots=True)
class StepTokenCounts:
    """`counts[i]`: steps with at most `STEP_TOKEN_BOUNDS[i]` tokens (and more than the bound
    before); the last entry counts steps above every bound. `total`: tokens over all steps."""

    counts: tuple[int, ...]
    total: int

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, steps with at most le tokens) in Prometheus' histogram form, "+Inf" last."""
        out, running = [], 0
        for bound, count in zip((*map(str, map(float, STEP_TOKEN_BOUNDS)), "+Inf"),
                                self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out


class StepTokens:
    """Counts steps by how many tokens they computed; `observe` once per step that ran."""

    def __init__(self) -> None:
        self._counts = [0] * (len(STEP_TOKEN_BOUNDS) + 1)
        self._total = 0

    def observe(self, num_tokens: int) -> None:
        index = next((i for i, bound in enumerate(STEP_TOKEN_BOUNDS) if num_tokens <= bound),
                     len(STEP_TOKEN_BOUNDS))
        self._counts[index] += 1
        self._total += num_tokens

    def snapshot(self) -> StepTokenCounts:
        return StepTokenCounts(tuple(self._counts), self._total)
