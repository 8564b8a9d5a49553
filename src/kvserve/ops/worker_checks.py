"""Checks on one worker from two snapshots: leaks, corruption, audit, thrashing, saturation,
misconfiguration. Pure: each takes an `Observation` and returns findings, reading nothing else.

Counters are compared across the window (`delta`), gauges must hold in both snapshots, so a
single busy instant never reads as a fault.
"""

from __future__ import annotations

from typing import Any

from kvserve.ops import vllm_worker_checks as vllm_checks
from kvserve.ops.findings import Finding, Problem, Severity
from kvserve.ops.scrape import Kind, Metrics, Observation
from kvserve.ops.vllm_worker_checks import check_idle_usage, not_checked, usage

LEAK_KINDS = frozenset({"leak", "held_while_idle"})
CORRUPTION_KINDS = frozenset({"epoch_mismatch", "stale_hash", "hash_map_mismatch",
                              "cross_tenant_share", "held_block_in_free_queue",
                              "duplicate_in_table"})
MAX_LISTED = 10
THRASH_HIT_RATE = 0.2  # below this (window) while evicting: the working set does not fit
# Requests finished in the window below which its hit rate is one prompt's luck, not the
# cache's state: a lone new prompt evicts and misses (the chaos soak's false alarms, 2 of 66).
MIN_WINDOW_REQUESTS = 4
QUEUE_WARN = 8  # requests waiting in both snapshots
KV_FULL = 0.95  # KV usage in both snapshots that, with requests waiting, names saturation
TINY_KV_REQUESTS = 4  # warn when fewer max-length requests than this fit in the KV cache


def delta(obs: Observation, name: str, **labels: str) -> float:
    """A counter's increase over the window (a restart in between counts from zero)."""
    a, b = obs.first.metrics, obs.second.metrics
    if a is None or b is None:
        return 0.0
    x, y = a.value(name, **labels), b.value(name, **labels)
    return y - x if y >= x else y


def _both(obs: Observation, name: str) -> tuple[float, float]:
    a, b = obs.first.metrics, obs.second.metrics
    assert a is not None and b is not None
    return a.value(name), b.value(name)


def _violations(obs: Observation) -> list[dict[str, Any]]:
    debug = obs.second.debug_kv or obs.first.debug_kv
    if not debug:
        return []
    return list(debug.get("audit", {}).get("violations", []))


def _holders(obs: Observation, only: set[str] | None) -> dict[str, str]:
    """Request id -> 'N blocks, idle Xs, age Ys' for requests holding blocks (/debug/kv)."""
    debug = obs.second.debug_kv or obs.first.debug_kv
    if not debug:
        return {}
    oldest = {e["request_id"]: e for e in debug.get("oldest_requests", [])}
    held: dict[str, int] = debug.get("held_blocks_by_request", {})
    listed = [(r, n) for r, n in held.items() if only is None or r in only][:MAX_LISTED]
    out = {}
    for request_id, num_blocks in listed:
        entry = oldest.get(request_id)
        timing = f", idle {entry['idle_s']:.1f}s, age {entry['age_s']:.1f}s" if entry else ""
        out[request_id] = f"{num_blocks} blocks{timing}"
    return out


def check_down(obs: Observation) -> list[Finding]:
    snap = obs.second
    if snap.error is not None:
        return [Finding(obs.url, Problem.DOWN, Severity.CRITICAL, "cannot read the target",
                        (snap.error,))]
    assert snap.metrics is not None
    evidence = []
    if snap.health_status not in (None, 200):
        evidence.append(f"/health answered {snap.health_status}: {snap.health}")
    if snap.metrics.get("kvserve:engine_up") == 0:
        evidence.append("kvserve:engine_up is 0: the engine loop has stopped")
    if evidence:
        return [Finding(obs.url, Problem.DOWN, Severity.CRITICAL, "the engine is down",
                        tuple(evidence))]
    return []


def check_leaks(obs: Observation) -> list[Finding]:
    """Held while idle; ledger outgrowing the scheduler; audit-proven leaks; allocations
    outpacing frees; and blocks the reaper had to reclaim."""
    held_a, held_b = _both(obs, "kvserve:kv_held_blocks")
    run_a, run_b = _both(obs, "vllm:num_requests_running")
    wait_a, wait_b = _both(obs, "vllm:num_requests_waiting")
    live_a, live_b = _both(obs, "kvserve:kv_live_requests")
    dt = obs.interval_s
    evidence: list[str] = []
    severity = Severity.WARNING
    idle = run_a == run_b == wait_a == wait_b == 0
    if idle and held_a > 0 and held_b > 0:
        severity = Severity.CRITICAL
        evidence.append(f"{held_a:.0f} then {held_b:.0f} KV blocks held {dt:.1f}s apart with "
                        "0 requests running or waiting (an idle worker holds 0)")
    if live_a > run_a + wait_a and live_b > run_b + wait_b:
        severity = Severity.CRITICAL
        evidence.append(f"the KV ledger lists {live_b:.0f} requests holding blocks; the "
                        f"scheduler has {run_b:.0f} running and {wait_b:.0f} waiting")
    leaked = {v["request_id"] for v in _violations(obs)
              if v.get("kind") == "leak" and v.get("request_id")}
    if leaked:
        severity = Severity.CRITICAL
        evidence.extend(v["message"] for v in _violations(obs)
                        if v.get("kind") in LEAK_KINDS)
    # Releases count references (prefix hits add some without an allocation), so a window
    # that ends idle yet allocated more than it released kept the difference: never healthy.
    allocated = delta(obs, "kvserve:kv_allocated_blocks_total")
    freed = delta(obs, "kvserve:kv_freed_blocks_total")
    if allocated > freed and run_b == wait_b == 0 and held_b > 0:
        evidence.append(f"allocated {allocated:.0f} blocks but released {freed:.0f} in "
                        f"{dt:.1f}s, then went idle holding {held_b:.0f}")
    findings = []
    if evidence:
        holders = _holders(obs, leaked or None) if (leaked or idle) else {}
        ids = tuple(sorted(leaked)) if leaked else tuple(holders)
        if holders:
            evidence.append("requests holding blocks: "
                            + "; ".join(f"{r}: {h}" for r, h in holders.items()))
        title = (f"KV blocks leak: {held_b:.0f} blocks held by {len(ids) or live_b:.0f} "
                 "requests that will never free them" if severity is Severity.CRITICAL
                 else "KV frees fall behind allocations")
        findings.append(Finding(obs.url, Problem.LEAK, severity, title, tuple(evidence), ids))
    assert obs.second.metrics is not None
    reclaimed = obs.second.metrics.value("kvserve:kv_reclaimed_blocks_total")
    if reclaimed > 0:
        window = delta(obs, "kvserve:kv_reclaimed_blocks_total")
        findings.append(Finding(
            obs.url, Problem.LEAK, Severity.WARNING,
            f"the reaper reclaimed {reclaimed:.0f} KV blocks from requests nobody freed",
            (f"{window:.0f} of them in the last {dt:.1f}s",
             "a free path (abort, timeout, disconnect, error) misses requests: the leak is "
             "contained, not fixed; kvserve:kv_request_frees_total by reason shows which")))
    return findings


def check_integrity(obs: Observation) -> list[Finding]:
    """Corruption detections, and audits that fail (the doctor's own /debug/kv audit aside)."""
    b = obs.second.metrics
    assert b is not None
    dt = obs.interval_s
    violations = _violations(obs)
    findings = []
    detections = b.value("kvserve:kv_corruption_detections_total")
    corrupt = [v["message"] for v in violations if v.get("kind") in CORRUPTION_KINDS]
    if detections > 0 or corrupt:
        window = delta(obs, "kvserve:kv_corruption_detections_total")
        findings.append(Finding(
            obs.url, Problem.CORRUPTION, Severity.CRITICAL,
            f"KV cache corruption: {detections:.0f} detections since start",
            (f"{window:.0f} in the last {dt:.1f}s", *corrupt[:MAX_LISTED],
             "the worker log's 'cache corruption' lines name request, block and both epochs")))
    debug = obs.second.debug_kv
    own = 1 if obs.first.debug_kv and not obs.first.debug_kv["audit"]["ok"] else 0
    failures = b.value("kvserve:kv_audit_failures_total") - own
    if debug is not None and not debug["audit"]["ok"]:
        kinds: dict[str, int] = {}
        for v in violations:
            kinds[v.get("kind", "?")] = kinds.get(v.get("kind", "?"), 0) + 1
        others = [v["message"] for v in violations
                  if v.get("kind") not in LEAK_KINDS | CORRUPTION_KINDS]
        census = debug["audit"].get("census", {})
        findings.append(Finding(
            obs.url, Problem.AUDIT, Severity.CRITICAL,
            f"the KV cache audit fails now ({len(violations)} violations)",
            ("violations by kind: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())),
             f"blocks: {census.get('held')} held, {census.get('free_cached')} free cached, "
             f"{census.get('free_uncached')} free uncached of {census.get('num_blocks')}",
             *others[:MAX_LISTED],
             f"kvserve:kv_audit_failures_total: {failures:.0f} (the doctor's audits aside)")))
    elif failures > 0:
        findings.append(Finding(
            obs.url, Problem.AUDIT, Severity.WARNING,
            f"{failures:.0f} KV cache audits failed since start (the latest passes)",
            ("a broken invariant was found and (if it was a leak) reaped; the worker log "
             "holds the report",)))
    return findings


def hit_rates(obs: Observation) -> tuple[float | None, float | None]:
    """(window, since start) prefix-cache hit rates, None where nothing was looked up."""
    b = obs.second.metrics
    assert b is not None
    q = delta(obs, "vllm:prefix_cache_queries_total")
    h = delta(obs, "vllm:prefix_cache_hits_total")
    life_q = b.value("vllm:prefix_cache_queries_total")
    life_h = b.value("vllm:prefix_cache_hits_total")
    return (h / q if q else None), (life_h / life_q if life_q else None)


def check_thrashing(obs: Observation) -> list[Finding]:
    """Evicting cached blocks fast while almost nothing hits, or a hit rate that collapsed;
    a window counts only with MIN_WINDOW_REQUESTS finished in it, else the life so far."""
    b = obs.second.metrics
    assert b is not None
    dt = obs.interval_s
    window_rate, life_rate = hit_rates(obs)
    if delta(obs, "vllm:request_prompt_tokens_count") < MIN_WINDOW_REQUESTS:
        window_rate = None  # too few requests: judge by the whole life only
    blocks = b.value("kvserve:kv_blocks") or float(vllm_checks.num_blocks(b) or 0)
    evicted = delta(obs, "kvserve:kv_evicted_blocks_total")
    allocated = delta(obs, "kvserve:kv_allocated_blocks_total")
    tenants = {t for t, v in b.by_label("kvserve:tenant_prefix_cache_queries_total",
                                        "tenant").items() if v > 0}
    evidence = []
    if (window_rate is not None and window_rate < THRASH_HIT_RATE and allocated > 0
            and evicted >= max(8.0, 0.5 * allocated)):
        evidence.append(f"evicted {evicted:.0f} cached blocks in {dt:.1f}s "
                        f"({evicted / dt:.1f}/s, {evicted / allocated:.0%} of new blocks) while "
                        f"{window_rate:.0%} of prompt tokens hit the prefix cache")
    elif (window_rate is None and life_rate is not None and life_rate < THRASH_HIT_RATE
          and blocks and b.value("kvserve:kv_allocated_blocks_total") >= blocks
          and b.value("kvserve:kv_evicted_blocks_total")
          >= 0.5 * b.value("kvserve:kv_allocated_blocks_total")):
        evidence.append(f"since start: {b.value('kvserve:kv_evicted_blocks_total'):.0f} "
                        f"evictions for {b.value('kvserve:kv_allocated_blocks_total'):.0f} "
                        f"allocations, {life_rate:.0%} of prompt tokens hit")
    if (window_rate is not None and life_rate is not None and life_rate >= 0.4
            and window_rate < 0.5 * life_rate):
        evidence.append(f"hit rate {window_rate:.0%} in the last {dt:.1f}s, down from "
                        f"{life_rate:.0%} since start")
    if not evidence:
        return []
    block_size = _cache_config(b).get("block_size", "?")
    who = f"{len(tenants)} tenants share" if tenants else "the traffic shares"
    evidence.append(f"{who} this worker's {blocks:.0f} blocks x {block_size} tokens: "
                    "prefixes evict each other (or the traffic shares no prefix at all)")
    return [Finding(obs.url, Problem.THRASHING, Severity.WARNING,
                    "prefix cache thrashing: cached prefixes are evicted before reuse",
                    tuple(evidence))]


def check_saturation(obs: Observation) -> list[Finding]:
    wait_a, wait_b = _both(obs, "vllm:num_requests_waiting")
    _, running = _both(obs, "vllm:num_requests_running")
    dt = obs.interval_s
    evidence = []
    a, b = obs.first.metrics, obs.second.metrics
    assert a is not None and b is not None
    if wait_a >= QUEUE_WARN and wait_b >= QUEUE_WARN:
        evidence.append(f"{wait_a:.0f} then {wait_b:.0f} requests waiting ({running:.0f} "
                        "running)")
    if usage(a) >= KV_FULL and usage(b) >= KV_FULL and wait_a > 0 and wait_b > 0:
        capacity = b.get("vllm:num_requests_waiting_by_reason", reason="capacity")
        why = "" if capacity is None else f", {capacity:.0f} of them for lack of capacity"
        evidence.append(f"KV cache {usage(a):.0%} then {usage(b):.0%} used with {wait_a:.0f} "
                        f"then {wait_b:.0f} requests waiting{why}: the KV cache, not "
                        "compute, limits the batch")
    # a kvserve worker counts each 429 in both; vLLM only in its own
    rejected = delta(obs, "kvserve:requests_rejected_total"
                     if b.has("kvserve:requests_rejected_total")
                     else "vllm:admission_rejections_total")
    if rejected > 0:
        evidence.append(f"refused {rejected:.0f} requests (429) in {dt:.1f}s")
    preempted = delta(obs, "vllm:num_preemptions_total")
    if preempted > 0:
        evidence.append(f"{preempted:.0f} preemptions in {dt:.1f}s: running requests lose "
                        "their KV blocks (the cache is too small for the batch)")
    if not evidence:
        return []
    return [Finding(obs.url, Problem.SATURATION, Severity.WARNING,
                    "the worker is saturated", tuple(evidence))]


def _cache_config(metrics: Metrics) -> dict[str, str]:
    labels = metrics.labels_of("vllm:cache_config_info")
    return labels[0] if labels else {}


def block_size_of(obs: Observation) -> int | None:
    metrics = obs.second.metrics or obs.first.metrics
    size = _cache_config(metrics).get("block_size") if metrics else None
    return int(size) if size and size.isdigit() else None


def check_config(obs: Observation) -> list[Finding]:
    """A KV cache too small for the model's context (from /v1/models' max_model_len)."""
    b = obs.second.metrics
    assert b is not None
    config = _cache_config(b)
    models = (obs.second.models or {}).get("data") or [{}]
    max_model_len = models[0].get("max_model_len")
    try:
        tokens = int(config["num_gpu_blocks"]) * int(config["block_size"])
    except (KeyError, ValueError):
        return []
    if not max_model_len:
        return []
    shape = (f"{config['num_gpu_blocks']} blocks x {config['block_size']} tokens = {tokens} "
             f"tokens of KV; max_model_len {max_model_len}")
    if tokens < max_model_len:
        return [Finding(obs.url, Problem.MISCONFIGURATION, Severity.CRITICAL,
                        "the KV cache cannot hold one max-length request", (shape,))]
    if tokens < TINY_KV_REQUESTS * max_model_len:
        return [Finding(obs.url, Problem.MISCONFIGURATION, Severity.WARNING,
                        f"tiny KV cache: only {tokens / max_model_len:.1f} max-length requests "
                        "fit", (shape, "raise --kv-cache-memory-bytes / --num-kv-blocks, or "
                                "lower --max-model-len"))]
    return []


def check_worker(obs: Observation) -> list[Finding]:
    """Every worker check, in the order on-call should read them."""
    down = check_down(obs)
    if obs.second.error is not None or obs.first.error is not None:
        return down or [Finding(obs.url, Problem.DOWN, Severity.CRITICAL,
                                "cannot read the target", (str(obs.first.error),))]
    findings = list(down)
    if obs.kind is Kind.KVSERVE_WORKER:
        findings += check_integrity(obs) + check_leaks(obs)
        if obs.second.debug_error is not None:
            findings.append(Finding(obs.url, Problem.NOTE, Severity.INFO,
                                    f"could not read /debug/kv ({obs.second.debug_error})",
                                    ("pass --admin-key to see which requests hold blocks",)))
    findings += check_thrashing(obs) + check_saturation(obs) + check_config(obs)
    if obs.kind is Kind.VLLM_WORKER:
        findings += check_idle_usage(obs) + not_checked(obs)
    return findings
