"""Cache statistics as plain data: counters only grow; gauges are read at snapshot time."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.kvcache.host_tier import HostTierStats
from kvserve.kvcache.types import FreeReason


@dataclass(slots=True)
class KVCacheCounters:
    """Monotonic counters, updated by the cache as it works (never reset while serving)."""

    prefix_queries_tokens: int = 0  # prompt tokens looked up at admission
    prefix_hits_tokens: int = 0  # of those, tokens served from the cache (host tier included)
    allocated_blocks: int = 0
    freed_blocks: int = 0
    evicted_blocks: int = 0
    hash_collisions: int = 0  # hash matched but the tokens did not: the hit was refused
    corruption_detections: int = 0
    reclaimed_blocks: int = 0  # freed by the reaper from requests nobody freed
    reaped_requests: int = 0
    redundant_frees: int = 0  # free() of a request that was already freed (idempotent no-op)
    audit_runs: int = 0  # full audits
    idle_checks: int = 0  # idle checks from counts (a failed one runs a full audit too)
    audit_failures: int = 0
    swapped_out_requests: int = 0  # preemptions by swapping (KV copied to the host tier)
    swapped_in_requests: int = 0  # swapped-out requests resumed (KV copied back)
    swap_fallbacks: int = 0  # swaps refused (host tier full) or lost (failed step): recompute
    frees_by_reason: dict[FreeReason, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    """A point-in-time view: the counters plus the gauges users chart.

    `usage` counts evictable cached blocks as free, as vLLM's `kv_cache_usage_perc` does.
    `host` is the host tier's own view, None when the cache has no host tier; `disk` the disk
    tier's, None without one.
    """

    num_blocks: int
    block_size: int
    num_free_blocks: int  # free-uncached + free-cached
    num_cached_free_blocks: int  # free but still hit-able
    num_held_blocks: int
    num_live_requests: int
    counters: KVCacheCounters
    host: HostTierStats | None = None
    disk: HostTierStats | None = None

    @property
    def usage(self) -> float:
        return self.num_held_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def hit_rate(self) -> float:
        queries = self.counters.prefix_queries_tokens
        return self.counters.prefix_hits_tokens / queries if queries else 0.0
