"""The real routing policies on the multi-tenant scenario, and the retry storm."""

from __future__ import annotations

from kvserve.sim import Backpressure, ClientConfig, SimResult, load_workload
from kvserve.workload import MultiTenantSpec
from tests.sim.helpers import H100, run


def test_prefix_affinity_beats_round_robin_when_the_working_set_exceeds_a_worker() -> None:
    # 16 tenants x ~27.5k-token prefixes = ~440k tokens; each worker caches 150k.
    spec = MultiTenantSpec(num_tenants=16, num_requests=200, rate_per_s=1.0, skew=0.0, seed=1)
    workload = load_workload("multi-tenant", spec=spec)
    assert sum(r.input_length for r in workload.requests[:64]) > 150_000
    rates = {}
    for policy in ("round_robin", "prefix_hash", "cache_aware"):
        result = run(workload, workers=4, capacity=150_000, block_size=64, profile=H100,
                     policy=policy)
        assert result.audit_ok and result.num_ok == len(workload.requests)
        rates[policy] = result.hit_rate
    assert rates["prefix_hash"] > 2 * rates["round_robin"]
    assert rates["prefix_hash"] - rates["round_robin"] > 0.3
    assert rates["cache_aware"] > 2 * rates["round_robin"]


def test_retries_without_backpressure_multiply_the_load() -> None:
    # Two workers, far more long prompts than they can prefill: clients time out at 5 s.
    spec = MultiTenantSpec(num_tenants=8, num_requests=120, rate_per_s=2.0, skew=0.0, seed=3)
    workload = load_workload("multi-tenant", spec=spec)
    common = dict(workers=2, capacity=80_000, block_size=64, profile=H100,
                  client=ClientConfig.retrying(5.0, 3))
    storm = run(workload, **common)  # type: ignore[arg-type]
    held = run(workload, backpressure=Backpressure(max_in_flight=4, max_queued=0),
               **common)  # type: ignore[arg-type]
    assert storm.audit_ok and held.audit_ok
    assert storm.num_retries > 2 * held.num_retries
    assert storm.num_attempts > 2 * held.num_attempts  # requests the workers had to take
    assert held.num_throttled > 0 and storm.num_throttled == 0
    assert held.num_ok > 2 * storm.num_ok  # and the fleet answers instead of thrashing
    assert storm.wasted_tokens / storm.computed_tokens > held.wasted_tokens / held.computed_tokens


def test_workers_can_carry_a_real_gateways_ids() -> None:
    """Rendezvous ranks workers by id: with the real fleet's URLs as ids, a simulated
    prefix_hash sends each tenant where the gateway's policy ranks first for its key."""
    import pytest

    from kvserve.gateway.core.pipeline import PrefixHashPolicy, WorkerView
    from kvserve.sim import RouteKeys
    from kvserve.workload import prompt_token_ids

    urls = ("http://127.0.0.1:41001", "http://127.0.0.1:41002", "http://127.0.0.1:41003")
    spec = MultiTenantSpec(num_tenants=6, num_requests=12, prefix_tokens=(600, 700),
                           suffix_tokens=(8, 16), output_tokens=2, rate_per_s=0.5, seed=3)
    workload = load_workload("multi-tenant", spec=spec)
    result = run(workload, workers=3, policy="prefix_hash", worker_ids=urls)
    keys, policy = RouteKeys(64), PrefixHashPolicy()
    views = [WorkerView(worker_id=u, healthy=True, in_flight=0) for u in urls]
    expected = dict.fromkeys(urls, 0)
    for request in workload.requests:  # one at a time: no load, so no spill
        expected[policy.route(keys.route_request(request, prompt_token_ids(request)),
                              views).worker_id] += 1
    assert {w.worker_id: w.routed for w in result.workers} == expected
    with pytest.raises(ValueError, match="distinct"):
        run(workload, workers=2, worker_ids=("a", "a"))


def _storm(backpressure: Backpressure) -> SimResult:
    """Two workers, 8 tenants of ~27.5k-token prompts at 2/s, clients that resend after 5 s
    without a first token (at most 3 times), behind `backpressure`."""
    spec = MultiTenantSpec(num_tenants=8, num_requests=120, rate_per_s=2.0, skew=0.0, seed=3)
    return run(load_workload("multi-tenant", spec=spec), workers=2, capacity=80_000,
               block_size=64, profile=H100, client=ClientConfig.retrying(5.0, 3),
               backpressure=backpressure)


def test_the_latency_limit_holds_back_what_the_workers_cannot_answer_in_time() -> None:
    kvserve_workers = _storm(Backpressure())  # they declare their batch: the limit stays off
    assert kvserve_workers.audit_ok
    assert kvserve_workers.num_ok == _storm(Backpressure(latency_limit=False)).num_ok
    # The gateway knows no batch size (a vLLM fleet before a scrape saw it full): 256 may go
    # upstream, so without the latency limit the workers queue what they cannot start before
    # the clients' 5 s timeout, and those time out after admission and resend.
    slots_only = _storm(Backpressure(latency_limit=False, declared_batch=False))
    limited = _storm(Backpressure(declared_batch=False))
    assert slots_only.audit_ok and limited.audit_ok
    assert limited.num_retries * 2 < slots_only.num_retries
    assert limited.num_gave_up * 4 < slots_only.num_gave_up
    assert limited.num_ok > 3 * slots_only.num_ok
    assert limited.num_throttled > 0  # the rest waited at the gateway, then backed off


def test_resends_that_keep_their_place_shorten_the_tail_and_lose_nothing() -> None:
    # The storm above, with the latency limit: the gateway queues each resend in the place of
    # its first send (gateway.seniority), or, without seniority, behind every younger request.
    by_arrival = _storm(Backpressure(seniority=False, declared_batch=False))
    by_first_send = _storm(Backpressure(declared_batch=False))
    assert by_arrival.audit_ok and by_first_send.audit_ok
    assert by_first_send.num_ok == by_first_send.num_requests > by_arrival.num_ok
    assert by_first_send.num_retries * 2 < by_arrival.num_retries
    assert by_first_send.ttft_p99 is not None and by_arrival.ttft_p99 is not None
    assert by_first_send.ttft_p99 < 0.85 * by_arrival.ttft_p99
