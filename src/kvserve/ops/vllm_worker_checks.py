"""Checks for a worker that exports only vLLM's metrics, and the list of checks that need
kvserve's own: a plain vLLM worker gets every diagnosis its metrics allow, and is told which
ones it cannot get, rather than a "healthy" that silently skipped them. Pure, like the others.
"""

from __future__ import annotations

from kvserve.ops.findings import Finding, Problem, Severity
from kvserve.ops.scrape import Metrics, Observation

# (what the doctor checks, the series it reads): each needs a kvserve worker's own metrics.
KVSERVE_ONLY_CHECKS = (
    ("KV cache corruption (block epochs, cached keys re-checked)",
     "kvserve:kv_corruption_detections_total"),
    ("the cache audit (conservation, refcounts, free queue, hash map, ledger)",
     "kvserve:kv_audit_failures_total"),
    ("blocks held by requests that ended (the KV ledger against the scheduler)",
     "kvserve:kv_live_requests"),
    ("frees falling behind allocations", "kvserve:kv_allocated_blocks_total"),
    ("blocks the reaper reclaimed from requests nobody freed",
     "kvserve:kv_reclaimed_blocks_total"),
    ("which requests hold blocks, and exact held block counts (/debug/kv)",
     "kvserve:kv_held_blocks"),
    ("eviction thrashing (evictions against allocations; a hit-rate collapse is still checked)",
     "kvserve:kv_evicted_blocks_total"),
    ("the engine loop (kvserve:engine_up; /health is still checked)", "kvserve:engine_up"),
    ("tenants spread over workers (per-tenant prompt tokens, for a gateway's diagnosis)",
     "kvserve:tenant_prefix_cache_queries_total"),
)


def usage(metrics: Metrics) -> float:
    return metrics.value("vllm:kv_cache_usage_perc")


def num_blocks(metrics: Metrics) -> int | None:
    """The KV cache's size in blocks, from vllm:cache_config_info (vLLM and kvserve both)."""
    for labels in metrics.labels_of("vllm:cache_config_info"):
        value = labels.get("num_gpu_blocks", "")
        if value.isdigit():
            return int(value)
    return None


def check_idle_usage(obs: Observation) -> list[Finding]:
    """The leak signature from vLLM's gauges alone: KV cache in use in both snapshots with
    nothing running or waiting in either. vllm:kv_cache_usage_perc counts cached prefixes as
    free, so an idle engine reads 0; anything above it is held by requests that are gone."""
    a, b = obs.first.metrics, obs.second.metrics
    assert a is not None and b is not None
    idle = all(m.value(name) == 0 for m in (a, b)
               for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"))
    if not idle or usage(a) <= 0 or usage(b) <= 0:
        return []
    blocks = num_blocks(b)
    held = f" (about {usage(b) * blocks:.0f} of {blocks} blocks)" if blocks else ""
    return [Finding(
        obs.url, Problem.LEAK, Severity.CRITICAL,
        f"KV blocks leak: {usage(b):.0%} of the KV cache held{held} with nothing running or "
        "waiting",
        (f"vllm:kv_cache_usage_perc {usage(a):.0%} then {usage(b):.0%} "
         f"{obs.interval_s:.1f}s apart with 0 requests running or waiting (cached prefixes "
         "count as free: an idle worker reads 0%)",
         "some ending (abort, timeout, disconnect, error) did not free its blocks; free "
         "blocks drift down until requests queue or are preempted",
         "this worker has no per-request view of who holds them: save its log, then restart "
         "it; kvserve workers name the requests (/debug/kv)"))]


def not_checked(obs: Observation) -> list[Finding]:
    """One note naming every check this worker's metrics cannot feed, and the series each
    needs; nothing when it exports them all (a kvserve worker)."""
    m = obs.second.metrics or obs.first.metrics
    if m is None:
        return []
    missing = [f"{what}: needs {series}" for what, series in KVSERVE_ONLY_CHECKS
               if not m.has(series)]
    if not missing:
        return []
    return [Finding(obs.url, Problem.NOTE, Severity.INFO,
                    f"not checked on {obs.url}: needs kvserve metrics "
                    f"({len(missing)} of {len(KVSERVE_ONLY_CHECKS)} kvserve-only checks)",
                    tuple(missing))]
