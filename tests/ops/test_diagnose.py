"""The doctor's pure core: from two hand-made snapshots to findings, one failure at a time."""

from __future__ import annotations

from typing import Any

from kvserve.ops.diagnose import diagnose
from kvserve.ops.findings import Problem, Report, Severity
from kvserve.ops.scrape import Kind, Metrics, Observation, Snapshot

W0, W1, GW = "http://w0:8000", "http://w1:8000", "http://gw:8080"


def worker_metrics(*, held: float = 0, running: float = 0, waiting: float = 0, live: float = 0,
                   allocated: float = 0, freed: float = 0, evicted: float = 0,
                   queries: float = 0, hits: float = 0, corruption: float = 0,
                   reclaimed: float = 0, audit_failures: float = 0, preemptions: float = 0,
                   rejected: float = 0, blocks: int = 512, block_size: int = 16,
                   tenants: dict[str, float] | None = None, finished: float = 0) -> Metrics:
    m = 'model_name="m"'
    lines = [
        f"vllm:num_requests_running{{{m}}} {running}",
        f"vllm:num_requests_waiting{{{m}}} {waiting}",
        f"vllm:kv_cache_usage_perc{{{m}}} {held / blocks}",
        f"vllm:prefix_cache_queries_total{{{m}}} {queries}",
        f"vllm:prefix_cache_hits_total{{{m}}} {hits}",
        f"vllm:num_preemptions_total{{{m}}} {preemptions}",
        f"vllm:request_prompt_tokens_count{{{m}}} {finished}",
        f'vllm:cache_config_info{{block_size="{block_size}",num_gpu_blocks="{blocks}",'
        'enable_prefix_caching="True"} 1',
        f"kvserve:kv_blocks{{{m}}} {blocks}",
        f"kvserve:kv_held_blocks{{{m}}} {held}",
        f"kvserve:kv_free_blocks{{{m}}} {blocks - held}",
        f"kvserve:kv_live_requests{{{m}}} {live}",
        f"kvserve:engine_up{{{m}}} 1",
        f"kvserve:kv_allocated_blocks_total{{{m}}} {allocated}",
        f"kvserve:kv_freed_blocks_total{{{m}}} {freed}",
        f"kvserve:kv_evicted_blocks_total{{{m}}} {evicted}",
        f"kvserve:kv_corruption_detections_total{{{m}}} {corruption}",
        f"kvserve:kv_reclaimed_blocks_total{{{m}}} {reclaimed}",
        f"kvserve:kv_audit_failures_total{{{m}}} {audit_failures}",
        f'kvserve:requests_rejected_total{{{m},cause="queue_full"}} {rejected}',
    ]
    lines += [f'kvserve:tenant_prefix_cache_queries_total{{{m},tenant="{t}"}} {v}'
              for t, v in (tenants or {}).items()]
    return Metrics.from_text("\n".join(lines) + "\n")


def gateway_metrics(*, healthy: dict[str, int], routed: dict[str, float],
                    policy: str = "prefix_hash", rejections: float = 0, retries: float = 0,
                    fleet_hit_rate: float = 0.9) -> Metrics:
    lines = [f'kvserve:gateway_worker_healthy{{worker="{w}"}} {v}' for w, v in healthy.items()]
    lines += [f'kvserve:gateway_requests_total{{worker="{w}",branch="affinity",'
              f'policy="{policy}"}} {n}' for w, n in routed.items()]
    lines += [f'kvserve:gateway_rejections_total{{reason="queue full"}} {rejections}',
              f'kvserve:gateway_retries_total{{reason="error"}} {retries}',
              f"kvserve:gateway_fleet_prefix_hit_rate {fleet_hit_rate}",
              "kvserve:gateway_queued_requests 0"]
    return Metrics.from_text("\n".join(lines) + "\n")


def observation(url: str, first: Metrics, second: Metrics, **extra: Any) -> Observation:
    return Observation(url, Snapshot(url, 0.0, first, 200, **extra),
                       Snapshot(url, 5.0, second, 200, **extra))


def problems(report: Report, problem: Problem) -> list[Any]:
    return [f for f in report.findings if f.problem is problem and f.severity > Severity.INFO]


def test_kind_is_told_from_metric_names() -> None:
    assert worker_metrics().kind() is Kind.KVSERVE_WORKER
    assert gateway_metrics(healthy={}, routed={}).kind() is Kind.GATEWAY
    vllm = Metrics.from_text('vllm:num_requests_running{model_name="m"} 0\n')
    assert vllm.kind() is Kind.VLLM_WORKER
    assert Metrics.from_text("process_cpu_seconds_total 1\n").kind() is Kind.UNKNOWN


def test_busy_healthy_worker_has_no_findings() -> None:
    first = worker_metrics(held=40, running=4, live=4, allocated=1000, freed=1200, evicted=10,
                           queries=10_000, hits=9_000)
    second = worker_metrics(held=38, running=4, live=4, allocated=1100, freed=1330, evicted=12,
                            queries=11_000, hits=9_900)
    report = diagnose([observation(W0, first, second)])
    assert report.exit_code == 0 and report.findings == ()


def test_idle_worker_holding_blocks_is_a_critical_leak_naming_requests() -> None:
    debug = {"audit": {"ok": False, "violations": [
        {"kind": "leak", "message": "request 'r1' is not live but holds 3 blocks",
         "request_id": "r1", "block_id": 0}], "census": {}},
        "held_blocks_by_request": {"r1": 3},
        "oldest_requests": [{"request_id": "r1", "age_s": 70.0, "idle_s": 65.0,
                             "num_blocks": 3}]}
    leak = worker_metrics(held=3, live=1, audit_failures=1)
    report = diagnose([observation(W0, leak, leak, debug_kv=debug)])
    (finding,) = problems(report, Problem.LEAK)
    assert finding.severity is Severity.CRITICAL and finding.request_ids == ("r1",)
    assert any("idle 65.0s" in e for e in finding.evidence)
    assert report.exit_code == 2


def test_frees_behind_allocations_warns_once_idle() -> None:
    first = worker_metrics(held=10, running=2, live=2, allocated=100, freed=90)
    second = worker_metrics(held=20, allocated=140, freed=110)
    (finding,) = problems(diagnose([observation(W0, first, second)]), Problem.LEAK)
    assert finding.severity is Severity.WARNING and "released 20" in finding.evidence[0]
    # requests still decoding allocate without releasing: that is no leak
    growing = worker_metrics(held=30, running=2, live=2, allocated=140, freed=90)
    assert not diagnose([observation(W0, first, growing)]).findings


def test_reclaimed_blocks_and_corruption() -> None:
    first = worker_metrics(reclaimed=4, corruption=0)
    second = worker_metrics(reclaimed=6, corruption=1)
    report = diagnose([observation(W0, first, second)])
    assert [f.severity for f in problems(report, Problem.LEAK)] == [Severity.WARNING]
    (corrupt,) = problems(report, Problem.CORRUPTION)
    assert corrupt.severity is Severity.CRITICAL and report.exit_code == 2
    assert report.findings[0] is corrupt  # the most severe first


def test_evicting_while_nothing_hits_is_thrashing() -> None:
    first = worker_metrics(allocated=100, evicted=50, queries=1_000, hits=10, blocks=48)
    second = worker_metrics(allocated=200, evicted=140, queries=2_000, hits=20, blocks=48,
                            finished=8)
    (finding,) = problems(diagnose([observation(W0, first, second)]), Problem.THRASHING)
    assert "evicted 90 cached blocks" in finding.evidence[0]


def test_one_new_prompt_in_a_window_is_not_thrashing() -> None:
    """A lone request with a new prompt misses and evicts: too few to judge the window by,
    and a cache that hit 70% over its life is not thrashing (the chaos soak's false alarms)."""
    first = worker_metrics(allocated=1_000, evicted=300, queries=10_000, hits=7_000)
    for finished in (1, 3):
        second = worker_metrics(allocated=1_010, evicted=309, queries=10_150, hits=7_000,
                                finished=finished)
        assert not problems(diagnose([observation(W0, first, second)]), Problem.THRASHING)
    second = worker_metrics(allocated=1_100, evicted=390, queries=11_500, hits=7_000,
                            finished=8)  # eight prompts, none hitting: the collapse is real
    (finding,) = problems(diagnose([observation(W0, first, second)]), Problem.THRASHING)
    assert any("down from 61%" in e for e in finding.evidence)


def test_block_size_mismatch_and_tiny_kv_cache() -> None:
    models = {"data": [{"id": "m", "max_model_len": 4096}]}
    a = worker_metrics(blocks=2048, block_size=16)
    b = worker_metrics(blocks=200, block_size=32)
    report = diagnose([observation(W0, a, a, models=models), observation(W1, b, b, models=models)])
    config = problems(report, Problem.MISCONFIGURATION)
    assert {(f.target, f.severity) for f in config} == {
        ("fleet", Severity.WARNING), (W1, Severity.WARNING)}  # 6400 tokens: 1.6 requests


def test_gateway_saturation_unhealthy_worker_and_round_robin_thrashing() -> None:
    tenants = {f"t{i}": 1000.0 for i in range(4)}
    w_first = worker_metrics(queries=4_000, hits=40, tenants=tenants)
    w_second = worker_metrics(queries=8_000, hits=80, tenants={t: 2000.0 for t in tenants})
    workers = [{"url": W0, "last_error": None}, {"url": W1, "last_error": "ConnectError"}]
    first = gateway_metrics(healthy={W0: 1, W1: 0}, routed={W0: 50, W1: 50},
                            policy="round_robin", rejections=0)
    second = gateway_metrics(healthy={W0: 1, W1: 0}, routed={W0: 60, W1: 60},
                             policy="round_robin", rejections=7)
    report = diagnose([
        observation(GW, first, second, workers={"policy": "round_robin", "workers": workers}),
        observation(W0, w_first, w_second), observation(W1, w_first, w_second)])
    (down,) = problems(report, Problem.DOWN)
    assert down.severity is Severity.WARNING and "ConnectError" in down.evidence[0]
    assert "answered 429/503 to 7" in problems(report, Problem.SATURATION)[0].evidence[0]
    thrash = [f for f in problems(report, Problem.THRASHING) if f.target == GW]
    assert thrash and "4 of 4 tenants" in " ".join(thrash[0].evidence)


def test_a_replica_unsafe_policy_on_workers_other_routers_use_is_a_misconfiguration() -> None:
    def report(detected: bool, replica_safe: bool) -> Report:
        metrics = gateway_metrics(healthy={W0: 1, W1: 1}, routed={W0: 50, W1: 50},
                                  policy="cache_aware")
        workers = {"policy": "cache_aware",
                   "shared_workers": {"detected": detected, "foreign_share": 0.48,
                                      "replica_safe": replica_safe},
                   "workers": [{"url": W0, "foreign_requests": 3},
                               {"url": W1, "foreign_requests": 0}]}
        return diagnose([observation(GW, metrics, metrics, workers=workers)])

    (finding,) = problems(report(True, False), Problem.MISCONFIGURATION)
    assert finding.severity is Severity.WARNING and finding.target == GW
    assert "48% of the requests" in finding.evidence[0]
    assert f"{W0}: 3" in finding.evidence[1] and W1 not in finding.evidence[1]
    assert "cold_placement (rendezvous)" in finding.evidence[-1]
    assert not problems(report(False, False), Problem.MISCONFIGURATION)
    assert not problems(report(True, True), Problem.MISCONFIGURATION)  # default cache_aware


def test_answers_later_than_clients_wait_are_saturation_with_the_latency_limit() -> None:
    def gateway(expired: float, cuts: float, limit: float) -> Metrics:
        base = gateway_metrics(healthy={W0: 1}, routed={W0: 100})
        extra = (f'kvserve:gateway_deadline_expired_total{{stage="first_token"}} {expired}\n'
                 f"kvserve:gateway_latency_limit_cuts_total {cuts}\n"
                 f"kvserve:gateway_latency_limit {limit}\n"
                 f"kvserve:gateway_admission_limit {limit}\n")
        return Metrics(base.families, base.samples + Metrics.from_text(extra).samples)

    calm = diagnose([observation(GW, gateway(3, 2, 64), gateway(3, 2, 64))])
    assert not problems(calm, Problem.SATURATION)  # old news: nothing in the window
    report = diagnose([observation(GW, gateway(3, 2, 64), gateway(15, 6, 4))])
    (finding,) = problems(report, Problem.SATURATION)
    assert "12 requests passed their clients' timeout" in finding.evidence[0]
    assert "first_token: 12" in finding.evidence[0]
    assert "cut the latency limit 4 times, to 4 requests in flight" in finding.evidence[1]


def test_clients_resending_what_the_fleet_has_not_answered_is_saturation() -> None:
    def gateway(routed: float, resent: float) -> Metrics:
        base = gateway_metrics(healthy={W0: 1}, routed={W0: routed})
        extra = f"kvserve:gateway_resends_total {resent}\n"
        return Metrics(base.families, base.samples + Metrics.from_text(extra).samples)

    few = diagnose([observation(GW, gateway(100, 0), gateway(200, 5))])
    assert not problems(few, Problem.SATURATION)  # 5 of 100: clients retrying now and then
    report = diagnose([observation(GW, gateway(100, 0), gateway(200, 40))])
    (finding,) = problems(report, Problem.SATURATION)
    assert "clients resent 40 requests the fleet had not answered" in finding.evidence[0]


def test_unreachable_target_is_critical() -> None:
    snap = Snapshot(W0, 0.0, error="/metrics: ConnectError")
    report = diagnose([Observation(W0, snap, snap)])
    assert report.exit_code == 2 and report.findings[0].problem is Problem.DOWN
    assert report.to_dict()["ok"] is False
