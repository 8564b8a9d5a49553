"""Checks on one gateway from two snapshots (and, for thrashing, what its workers show): worker
health, saturation (429s, queue, retry storms), tenant prefixes scattered across workers, and a
policy that is not replica-safe on workers other routers share. Pure, like the worker checks."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.ops.findings import Finding, Problem, Severity
from kvserve.ops.scrape import Observation
from kvserve.ops.worker_checks import delta

CACHE_OBLIVIOUS = frozenset({"round_robin", "least_load"})  # policies that ignore prefixes
FLEET_THRASH_HIT_RATE = 0.3
MIN_REQUESTS = 20  # below this, a gateway's hit rate says nothing
SPREAD_SHARE = 0.1  # a worker serving >= this share of a tenant's prompt tokens counts


@dataclass(frozen=True, slots=True)
class TenantSpread:
    """How tenants' prompt tokens are spread over `num_workers` workers: `spread` tenants were
    served by more than one (each counting workers with >= 10% of its tokens)."""

    num_workers: int
    num_tenants: int
    spread: int
    examples: tuple[str, ...]

    @classmethod
    def from_workers(cls, workers: list[Observation]) -> TenantSpread:
        """From the workers' kvserve:tenant_prefix_cache_queries_total: the window's traffic
        when there was any, else everything since start."""
        per_tenant: dict[str, dict[str, float]] = {}
        use_window = any(delta(o, "kvserve:tenant_prefix_cache_queries_total") > 0
                         for o in workers)
        for obs in workers:
            a, b = obs.first.metrics, obs.second.metrics
            if a is None or b is None:
                continue
            now = b.by_label("kvserve:tenant_prefix_cache_queries_total", "tenant")
            before = a.by_label("kvserve:tenant_prefix_cache_queries_total", "tenant")
            for tenant, total in now.items():
                amount = total - before.get(tenant, 0.0) if use_window else total
                if tenant not in ("none", "other") and amount > 0:
                    per_tenant.setdefault(tenant, {})[obs.url] = amount
        spread = 0
        examples: list[str] = []
        for tenant, by_worker in sorted(per_tenant.items()):
            total = sum(by_worker.values())
            shares = sorted((v / total for v in by_worker.values()), reverse=True)
            serving = [s for s in shares if s >= SPREAD_SHARE]
            if len(serving) > 1:
                spread += 1
                if len(examples) < 3:
                    examples.append(f"{tenant}: " + "/".join(f"{s:.0%}" for s in serving))
        return cls(len(workers), len(per_tenant), spread, tuple(examples))


def check_gateway(obs: Observation, workers: list[Observation]) -> list[Finding]:
    """`workers`: observations of the workers this gateway routes to (may be empty)."""
    snap = obs.second
    if snap.error is not None or obs.first.error is not None:
        return [Finding(obs.url, Problem.DOWN, Severity.CRITICAL, "cannot read the target",
                        (str(snap.error or obs.first.error),))]
    return (_check_health(obs) + _check_saturation(obs) + _check_thrashing(obs, workers)
            + _check_shared_workers(obs))


def _check_shared_workers(obs: Observation) -> list[Finding]:
    """A policy whose choices rest on what this gateway alone routed (`replica_safe` false in
    the gateway's /workers) on workers that serve other routers' requests too."""
    info = obs.second.workers or {}
    shared = info.get("shared_workers") or {}
    if not shared.get("detected") or shared.get("replica_safe", True):
        return []
    policy = _policy(obs) or "the policy"
    foreign = [f"{w['url']}: {w['foreign_requests']}" for w in info.get("workers", [])
               if w.get("foreign_requests")]
    evidence = [f"{shared.get('foreign_share', 0.0):.0%} of the requests the workers reported "
                "over the last minute were not sent by this gateway"]
    if foreign:
        evidence.append("requests from elsewhere at the last scrape: " + ", ".join(foreign))
    evidence += [f"{policy} places a new prefix by what this gateway alone has routed, so "
                 "replicas place a tenant on different workers and the hit rate falls",
                 "fix: run every replica with --policy cache_aware and its default "
                 "cold_placement (rendezvous), or --policy precise (kvserve workers) or "
                 "prefix_hash; send clients that bypass the gateway through it"]
    return [Finding(obs.url, Problem.MISCONFIGURATION, Severity.WARNING,
                    f"{policy} routes on workers that other routers also use",
                    tuple(evidence))]


def _check_health(obs: Observation) -> list[Finding]:
    b = obs.second.metrics
    assert b is not None
    healthy = b.by_label("kvserve:gateway_worker_healthy", "worker")
    down = sorted(w for w, v in healthy.items() if v == 0)
    if not down and obs.second.health_status in (None, 200):
        return []
    errors = {w["url"]: w.get("last_error") for w in
              (obs.second.workers or {}).get("workers", [])}
    evidence = [f"{w}: {errors.get(w) or 'unhealthy'}" for w in down]
    if obs.second.health_status not in (None, 200):
        evidence.insert(0, f"/health answered {obs.second.health_status}: {obs.second.health}")
    severity = Severity.CRITICAL if len(down) == len(healthy) else Severity.WARNING
    return [Finding(obs.url, Problem.DOWN, severity,
                    f"{len(down)} of {len(healthy)} workers are out of rotation",
                    tuple(evidence))]


def _check_saturation(obs: Observation) -> list[Finding]:
    a, b = obs.first.metrics, obs.second.metrics
    assert a is not None and b is not None
    dt = obs.interval_s
    evidence = []
    rejected = _increase_by(obs, "kvserve:gateway_rejections_total", "reason")
    if rejected:
        evidence.append(f"answered 429/503 to {sum(rejected.values()):.0f} requests in "
                        f"{dt:.1f}s ({_listing(rejected)})")
    queued_a, queued_b = (m.value("kvserve:gateway_queued_requests") for m in (a, b))
    if queued_a > 0 and queued_b > 0:
        evidence.append(f"{queued_a:.0f} then {queued_b:.0f} requests waiting for admission")
    routed = delta(obs, "kvserve:gateway_requests_total")
    retries = delta(obs, "kvserve:gateway_retries_total")
    if retries >= 3 and retries > 0.1 * routed:
        evidence.append(f"retry storm: {retries:.0f} retries for {routed:.0f} routed requests "
                        f"in {dt:.1f}s")
    resent = delta(obs, "kvserve:gateway_resends_total")
    if resent >= 3 and resent > 0.1 * (routed + sum(rejected.values())):
        evidence.append(f"clients resent {resent:.0f} requests the fleet had not answered "
                        f"(after a 429, a 504 or their own timeout) in {dt:.1f}s")
    denied = delta(obs, "kvserve:gateway_retry_budget_exhausted_total")
    if denied > 0:
        evidence.append(f"the retry budget refused {denied:.0f} retries")
    evidence += _slow_answers(obs)
    if not evidence:
        return []
    return [Finding(obs.url, Problem.SATURATION, Severity.WARNING, "the fleet is saturated",
                    tuple(evidence))]


def _slow_answers(obs: Observation) -> list[str]:
    """Workers answering later than the clients wait: deadlines that expired upstream, and
    the latency limit's cuts (the admission limit it left)."""
    b = obs.second.metrics
    assert b is not None
    evidence = []
    expired = _increase_by(obs, "kvserve:gateway_deadline_expired_total", "stage")
    if expired:
        evidence.append(f"{sum(expired.values()):.0f} requests passed their clients' timeout "
                        f"before a worker started answering ({_listing(expired)}); the "
                        "gateway closed them upstream")
    cuts = delta(obs, "kvserve:gateway_latency_limit_cuts_total")
    if cuts > 0:
        evidence.append(f"late first tokens cut the latency limit {cuts:.0f} times, to "
                        f"{b.value('kvserve:gateway_latency_limit'):.0f} requests in flight "
                        f"(admission limit {b.value('kvserve:gateway_admission_limit'):.0f}): "
                        "the workers answer later than the clients wait")
    return evidence


def _increase_by(obs: Observation, name: str, label: str) -> dict[str, float]:
    """How much counter `name` grew over the window, per value of `label` (where it grew)."""
    a, b = obs.first.metrics, obs.second.metrics
    assert a is not None and b is not None
    before = a.by_label(name, label)
    grown = {k: v - before.get(k, 0.0) for k, v in b.by_label(name, label).items()}
    return {k: v for k, v in grown.items() if v > 0}


def _listing(counts: dict[str, float]) -> str:
    return ", ".join(f"{k}: {v:.0f}" for k, v in sorted(counts.items()))


def _policy(obs: Observation) -> str | None:
    if obs.second.workers and obs.second.workers.get("policy"):
        return str(obs.second.workers["policy"])
    assert obs.second.metrics is not None
    policies = obs.second.metrics.by_label("kvserve:gateway_requests_total", "policy")
    return max(policies, key=lambda p: policies[p]) if policies else None


def fleet_hit_rate(obs: Observation, workers: list[Observation]) -> tuple[float | None, str]:
    """The fleet's prefix hit rate over the window (from the workers) when they had traffic,
    else the gateway's own since-start figure; and which one it is."""
    q = sum(delta(o, "vllm:prefix_cache_queries_total") for o in workers)
    h = sum(delta(o, "vllm:prefix_cache_hits_total") for o in workers)
    if q > 0:
        return h / q, f"over the last {obs.interval_s:.1f}s"
    assert obs.second.metrics is not None
    rate = obs.second.metrics.get("kvserve:gateway_fleet_prefix_hit_rate")
    return rate, "since the gateway started"


def _check_thrashing(obs: Observation, workers: list[Observation]) -> list[Finding]:
    b = obs.second.metrics
    assert b is not None
    per_worker = b.by_label("kvserve:gateway_requests_total", "worker")
    routed = sum(per_worker.values())
    policy = _policy(obs)
    rate, when = fleet_hit_rate(obs, workers)
    spread = TenantSpread.from_workers([w for w in workers if w.second.metrics is not None])
    if routed < MIN_REQUESTS or rate is None:
        return []
    oblivious = policy in CACHE_OBLIVIOUS
    scattered = spread.num_workers > 1 and spread.spread > 0 and \
        spread.spread * 2 >= spread.num_tenants
    if rate >= FLEET_THRASH_HIT_RATE or not (oblivious or scattered):
        if oblivious:
            return [Finding(obs.url, Problem.NOTE, Severity.INFO,
                            f"policy {policy} ignores prefixes (hit rate {rate:.0%} {when})",
                            ("fine while prompts share little; long shared prefixes need "
                             "--policy prefix_hash or cache_aware",))]
        return []
    evidence = [f"fleet prefix hit rate {rate:.0%} {when}"]
    if oblivious:
        evidence.append(f"policy {policy} ignores prefixes: it spreads every tenant over every "
                        "worker, so each worker must cache every tenant's prefix")
    evidence.append("requests per worker: " + ", ".join(
        f"{w} {n:.0f}" for w, n in sorted(per_worker.items())))
    if spread.num_tenants:
        evidence.append(f"{spread.spread} of {spread.num_tenants} tenants are served by more "
                        f"than one of {spread.num_workers} workers"
                        + (f" ({'; '.join(spread.examples)})" if spread.examples else ""))
    evicting = [o.url for o in workers
                if delta(o, "kvserve:kv_evicted_blocks_total") >= 8]
    if evicting:
        evidence.append("evicting cached blocks: " + ", ".join(evicting))
    evidence.append("fix: --policy prefix_hash (or cache_aware) keeps a tenant's prefix on "
                    "one worker")
    return [Finding(obs.url, Problem.THRASHING, Severity.WARNING,
                    "tenants' prefixes are scattered across workers: the fleet thrashes",
                    tuple(evidence))]
