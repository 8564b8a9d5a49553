"""Replay a trace through the KV cache manager with instantaneous compute.

Each request, in arrival order: look up its prompt's cached prefix, allocate the rest, commit the
whole prompt (its full blocks become shareable), free. This is an offline LRU replay: the hit rate
it reports is the ceiling a single worker of that capacity reaches on the trace.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvserve.kvcache import FreeReason, KVCacheManager
from kvserve.workload import TRACE_BLOCK_SIZE, TraceRequest, prompt_token_ids

OPS_PER_REQUEST = 3  # lookup, allocate, free: the same three calls the vLLM driver times


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """One replay's outcome. `hit_rate` = hit tokens / prompt tokens of admitted requests."""

    engine: str
    capacity_tokens: int
    block_size: int
    requests: int
    rejected: int  # prompts larger than the whole cache
    prompt_tokens: int
    hit_tokens: int
    evicted_blocks: int
    seconds: float

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ops(self) -> int:
        return OPS_PER_REQUEST * (self.requests - self.rejected)

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = asdict(self)
        out.update(hit_rate=self.hit_rate, ops=self.ops, ops_per_s=self.ops_per_s,
                   tokens_per_s=self.prompt_tokens / self.seconds if self.seconds else 0.0)
        return out


def replay_trace(
    requests: Sequence[TraceRequest], capacity_tokens: int, block_size: int
) -> ReplayResult:
    """Replay `requests` through a fresh manager of `capacity_tokens // block_size` blocks.

    Timed: the whole loop, token synthesis included (the vLLM driver times the same loop).
    """
    num_blocks = capacity_tokens // block_size
    if num_blocks < 1:
        raise ValueError(f"capacity of {capacity_tokens} tokens is less than one block")
    manager = KVCacheManager(num_blocks, block_size)
    rejected = prompt_tokens = 0
    start = time.perf_counter()
    for req in requests:
        tokens = prompt_token_ids(req, TRACE_BLOCK_SIZE)
        manager.add_request(req.request_id, tokens, cache_salt=req.tenant)
        hit = manager.lookup(req.request_id)
        if manager.allocate_slots(req.request_id, len(tokens) - hit.num_tokens, hit) is None:
            rejected += 1
            manager.free(req.request_id, FreeReason.ERROR)
            continue
        prompt_tokens += len(tokens)
        manager.commit(req.request_id, len(tokens))
        manager.free(req.request_id)
    seconds = time.perf_counter() - start
    report = manager.check_idle()
    assert report.ok, report.describe()
    counters = manager.counters
    return ReplayResult(
        engine="kvserve",
        capacity_tokens=capacity_tokens,
        block_size=block_size,
        requests=len(requests),
        rejected=rejected,
        prompt_tokens=prompt_tokens,
        hit_tokens=counters.prefix_hits_tokens,
        evicted_blocks=counters.evicted_blocks,
        seconds=seconds,
    )
