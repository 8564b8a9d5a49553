"""The tensor-parallel checks and the differential diagnosis that names one cause among several.

`check_collectives` reads a worker's collective series over the window: failed collectives
(critical: the worker is going down), a slow all_reduce p99 or a high rank skew (warning: a slow
or stalled rank, or a slow transport). `differential` then states, for each cause the doctor
knows (collective / slow rank, KV-cache corruption, leaked blocks, thrashing, saturation),
whether the window implicates it or rules it out, with the numbers either way, so on-call reads
"collectives healthy: all_reduce p99 3 ms over the last 60 s; not the cause" next to the cause
that is. Pure: each takes an `Observation` (and the other checks' findings), nothing else.
"""

from __future__ import annotations

from kvserve.ops.findings import Finding, Problem, Severity
from kvserve.ops.scrape import Metrics, Observation
from kvserve.ops.worker_checks import delta

DURATION = "kvserve:collective_duration_seconds"
ERRORS = "kvserve:collective_errors_total"
SKEW = "kvserve:collective_rank_skew_seconds"
SLOW_ALL_REDUCE_P99_S = 0.05  # the incident team's threshold, as in the alert
SLOW_SKEW_P99_S = 0.05

CAUSES = (Problem.COLLECTIVE, Problem.CORRUPTION, Problem.LEAK, Problem.THRASHING,
          Problem.SATURATION)


def is_tensor_parallel(obs: Observation) -> bool:
    m = obs.second.metrics
    return m is not None and m.value("kvserve:tensor_parallel_size") > 1


def window_quantile(obs: Observation, name: str, q: float, **labels: str) -> tuple[float | None,
                                                                                     int]:
    """(The q-quantile's bucket bound, the number of observations) of histogram `name` over
    the window; (None, 0) when nothing was observed."""
    m = obs.second.metrics
    assert m is not None
    bounds = sorted({lab["le"] for lab in m.labels_of(f"{name}_bucket")
                     if all(lab.get(k) == v for k, v in labels.items())}, key=float)
    counts = [delta(obs, f"{name}_bucket", le=b, **labels) for b in bounds]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None, 0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= q * total:
            return float(bound), int(total)
    return float(bounds[-1]), int(total)


def check_collectives(obs: Observation) -> list[Finding]:
    """Failed collectives, a slow all_reduce, a slow rank (tensor-parallel workers only)."""
    if not is_tensor_parallel(obs):
        return []
    m = obs.second.metrics
    assert m is not None
    findings = []
    failed = _errors(obs, m)
    if failed:
        findings.append(Finding(obs.url, Problem.COLLECTIVE, Severity.CRITICAL,
                                "tensor-parallel collectives failed",
                                tuple(failed) + ("the worker ends its requests, reports "
                                                 "unhealthy and exits 3; its log and /health "
                                                 "name the rank and the step",)))
    p99, n = window_quantile(obs, DURATION, 0.99, op="all_reduce")
    skew, steps = window_quantile(obs, SKEW, 0.99)
    if p99 is not None and p99 > SLOW_ALL_REDUCE_P99_S:
        evidence = [f"all_reduce p99 <= {_ms(p99)} over {n} calls in the last "
                    f"{obs.interval_s:.0f} s (threshold {_ms(SLOW_ALL_REDUCE_P99_S)})"]
        if skew is not None and skew > SLOW_SKEW_P99_S:
            slowest = int(m.value("kvserve:collective_slowest_rank"))
            evidence.append(f"rank skew p99 <= {_ms(skew)} over {steps} steps, slowest rank "
                            f"{slowest}: one rank computes slowly, the others wait for it")
        else:
            evidence.append("rank skew is low: the ranks keep pace, the transport is slow")
        findings.append(Finding(obs.url, Problem.COLLECTIVE, Severity.WARNING,
                                "tensor-parallel all_reduce is slow", tuple(evidence)))
    return findings


def differential(obs: Observation, findings: list[Finding]) -> Finding:
    """One line per known cause: implicated (with the finding's title) or ruled out, with the
    evidence either way."""
    m = obs.second.metrics
    assert m is not None
    implicated = {f.problem: f for f in findings if f.severity > Severity.INFO}
    lines = []
    for cause in CAUSES:
        if cause is Problem.COLLECTIVE and not is_tensor_parallel(obs):
            lines.append("collectives: not tensor-parallel (one rank); not the cause")
            continue
        if cause in implicated:
            lines.append(f"{cause.value}: THE CAUSE: {implicated[cause].title}")
        else:
            lines.append(f"{cause.value}: ruled out: {_healthy(cause, obs, m)}")
    named = [c.value for c in CAUSES if c in implicated]
    title = (f"differential diagnosis: {', '.join(named)}" if named
             else "differential diagnosis: no fault among the known causes")
    return Finding(obs.url, Problem.NOTE, Severity.INFO, title, tuple(lines))


def _healthy(cause: Problem, obs: Observation, m: Metrics) -> str:
    """The numbers that rule `cause` out over this window."""
    window = f"over the last {obs.interval_s:.0f} s"
    if cause is Problem.COLLECTIVE:
        p99, n = window_quantile(obs, DURATION, 0.99, op="all_reduce")
        errors = sum(m.value(ERRORS, op=op) for op in _ops(m))
        if p99 is None:
            return f"no collective ran {window}; {errors:.0f} failed since start"
        return (f"collectives healthy: all_reduce p99 <= {_ms(p99)} over {n} calls {window}, "
                f"{errors:.0f} errors since start")
    if cause is Problem.CORRUPTION:
        found = delta(obs, "kvserve:kv_corruption_detections_total")
        audits = delta(obs, "kvserve:kv_audit_failures_total")
        return f"{found:.0f} corruption detections and {audits:.0f} failed audits {window}"
    if cause is Problem.LEAK:
        return (f"{m.value('kvserve:kv_held_blocks'):.0f} blocks held by "
                f"{m.value('vllm:num_requests_running'):.0f} running requests, none by a "
                "finished one")
    if cause is Problem.THRASHING:
        evicted = delta(obs, "kvserve:kv_evicted_blocks_total")
        allocated = delta(obs, "kvserve:kv_allocated_blocks_total")
        return f"{evicted:.0f} evictions for {allocated:.0f} allocations {window}"
    return (f"{m.value('vllm:num_requests_waiting'):.0f} waiting, KV usage "
            f"{m.value('vllm:kv_cache_usage_perc'):.0%}")


def _errors(obs: Observation, m: Metrics) -> list[str]:
    """Failed collectives since start: a failed group is never repaired in place (the worker
    exits), so one counted before the window opened is as current as one counted in it."""
    out = []
    for lab in m.labels_of(ERRORS):
        n = m.value(ERRORS, op=lab["op"], kind=lab["kind"])
        if n > 0:
            window = delta(obs, ERRORS, op=lab["op"], kind=lab["kind"])
            out.append(f"{n:.0f} {lab['op']} failures of kind {lab['kind']} since start "
                       f"({window:.0f} in the last {obs.interval_s:.0f} s)")
    return out


def _ops(m: Metrics) -> set[str]:
    return {lab["op"] for lab in m.labels_of(ERRORS)}


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.0f} s"
