"""From observations (two snapshots per target) to a report: each target's checks by kind, the
fleet-wide checks across workers, and a summary line per target. Pure: no I/O, no clock."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvserve.ops.adapter_checks import check_adapter_thrashing
from kvserve.ops.collective_checks import (
    CAUSES,
    check_collectives,
    differential,
    is_tensor_parallel,
)
from kvserve.ops.findings import Finding, Problem, Report, Severity, TargetSummary
from kvserve.ops.gateway_checks import check_gateway, fleet_hit_rate
from kvserve.ops.scrape import Kind, Observation
from kvserve.ops.worker_checks import block_size_of, check_worker, hit_rates

# Within a severity: causes before symptoms (a leak before the audit that it fails).
READING_ORDER = (Problem.DOWN, Problem.COLLECTIVE, Problem.CORRUPTION, Problem.LEAK,
                 Problem.THRASHING, Problem.ADAPTER_THRASHING, Problem.SATURATION, Problem.AUDIT,
                 Problem.MISCONFIGURATION, Problem.NOTE)


def diagnose(observations: Sequence[Observation]) -> Report:
    """Every finding on every target, most severe first, causes before symptoms."""
    workers = [o for o in observations if o.kind.is_worker]
    findings: list[Finding] = []
    for obs in observations:
        if obs.kind is Kind.GATEWAY:
            findings += check_gateway(obs, workers_behind(obs, workers))
        elif obs.kind.is_worker:
            findings += with_differential(obs, check_worker(obs) + check_adapter_thrashing(obs))
        elif obs.first.error or obs.second.error:
            findings.append(Finding(obs.url, Problem.DOWN, Severity.CRITICAL,
                                    "cannot read the target",
                                    (str(obs.second.error or obs.first.error),)))
        else:
            findings.append(Finding(obs.url, Problem.NOTE, Severity.WARNING,
                                    "not a kvserve worker, vLLM worker or kvserve gateway",
                                    ("its /metrics has none of vllm:num_requests_running, "
                                     "kvserve:kv_held_blocks, kvserve:gateway_requests_total",)))
    findings += check_fleet(workers)
    findings.sort(key=lambda f: (-f.severity, READING_ORDER.index(f.problem)))
    interval = max((o.interval_s for o in observations), default=0.0)
    return Report(interval, tuple(summarize(o, workers) for o in observations), tuple(findings))


def with_differential(obs: Observation, found: list[Finding]) -> list[Finding]:
    """A worker's findings, its collective checks, and (on a tensor-parallel worker or one with
    a problem) the differential diagnosis that says which known cause it is and which not."""
    if obs.second.metrics is None or obs.first.metrics is None:
        return found
    found = found + check_collectives(obs)
    if is_tensor_parallel(obs) or any(f.problem in CAUSES and f.severity > Severity.INFO
                                      for f in found):
        found.append(differential(obs, found))
    return found


def workers_behind(gateway: Observation, workers: list[Observation]) -> list[Observation]:
    """The observed workers that `gateway` lists in its /workers."""
    listed = {str(w.get("url", "")).rstrip("/")
              for w in (gateway.second.workers or gateway.first.workers or {}).get("workers", [])}
    return [w for w in workers if w.url in listed]


def check_fleet(workers: list[Observation]) -> list[Finding]:
    """What no single worker shows: block sizes that differ across the fleet."""
    sizes: dict[int, list[str]] = {}
    for obs in workers:
        size = block_size_of(obs)
        if size is not None:
            sizes.setdefault(size, []).append(obs.url)
    if len(sizes) <= 1:
        return []
    return [Finding("fleet", Problem.MISCONFIGURATION, Severity.WARNING,
                    "workers use different KV block sizes",
                    tuple(f"block size {s}: {', '.join(urls)}" for s, urls in sorted(sizes.items()))
                    + ("prefix-aware routing hashes prompts in blocks: give every worker the "
                       "same --block-size",))]


def summarize(obs: Observation, workers: list[Observation]) -> TargetSummary:
    """Headline numbers for a target (the second snapshot's, rates over the window)."""
    m = obs.second.metrics
    if m is None:
        return TargetSummary(obs.url, "unreachable", {"error": obs.second.error})
    facts: dict[str, Any] = {}
    if obs.kind.is_worker:
        window, life = hit_rates(obs)
        facts = {"running": m.value("vllm:num_requests_running"),
                 "waiting": m.value("vllm:num_requests_waiting"),
                 "kv_usage": round(m.value("vllm:kv_cache_usage_perc"), 4),
                 "hit_rate_window": _round(window), "hit_rate_since_start": _round(life),
                 "block_size": block_size_of(obs)}
        if obs.kind is Kind.KVSERVE_WORKER:
            facts |= {"blocks": m.value("kvserve:kv_blocks"),
                      "held_blocks": m.value("kvserve:kv_held_blocks"),
                      "free_blocks": m.value("kvserve:kv_free_blocks")}
    elif obs.kind is Kind.GATEWAY:
        healthy = m.by_label("kvserve:gateway_worker_healthy", "worker")
        rate, _ = fleet_hit_rate(obs, workers_behind(obs, workers))
        facts = {"policy": (obs.second.workers or {}).get("policy"),
                 "workers": len(healthy), "healthy_workers": int(sum(healthy.values())),
                 "routed": m.value("kvserve:gateway_requests_total"),
                 "fleet_hit_rate": _round(rate)}
    return TargetSummary(obs.url, obs.kind.value, facts)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
