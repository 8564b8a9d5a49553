"""Every run ends with every worker's cache audited clean and no block held, whatever happened:
preemptions, client cancellations mid-step, 429s."""

from __future__ import annotations

import dataclasses

import pytest

from kvserve.sim import Backpressure, ClientConfig, SimConfig, WorkerConfig, load_workload
from kvserve.workload import MultiTenantSpec
from tests.sim.helpers import H100, run, synthetic_trace, with_outputs


@pytest.mark.parametrize("variant", ["patient", "retry", "retry-bp"])
def test_audits_pass_and_nothing_is_held_at_the_end(variant: str) -> None:
    spec = MultiTenantSpec(num_tenants=6, num_requests=80, rate_per_s=2.0, seed=5,
                           output_tokens=300)
    workload = load_workload("multi-tenant", spec=spec)
    client = ClientConfig() if variant == "patient" else ClientConfig.retrying(4.0, 2)
    # Without the latency limit, which would hold the load below where preemption starts.
    bp = Backpressure(max_in_flight=6, max_queued=4, queue_timeout_s=1.0,
                      latency_limit=False) if variant.endswith("bp") else None
    # A cache of ~2.5 prompts: preemption by recompute happens all the time.
    result = run(workload, workers=2, capacity=70_000, block_size=16, profile=H100,
                 policy="prefix_hash", client=client, backpressure=bp)
    assert result.audit_ok
    for worker in result.workers:
        assert worker.audit_ok and worker.held_blocks_at_end == 0
    assert result.num_preemptions > 0
    if variant != "patient":
        assert result.num_retries > 0 and result.wasted_tokens > 0
    assert result.num_ok + result.num_gave_up + result.num_rejected == result.num_requests


def test_same_seed_same_result() -> None:
    spec = MultiTenantSpec(num_tenants=6, num_requests=80, rate_per_s=3.0, seed=9, skew=1.0)
    workload = load_workload("multi-tenant", spec=spec)

    def once(policy: str) -> dict[str, object]:
        result = run(workload, workers=3, capacity=90_000, block_size=32, profile=H100,
                     policy=policy, client=ClientConfig.retrying(3.0, 2), seed=4)
        summary = result.summary()
        summary.pop("wall_s")
        return {**summary, "ttfts": result.ttfts,
                "timeline": [dataclasses.astuple(s) for s in result.timeline]}

    for policy in ("least_load", "cache_aware"):
        assert once(policy) == once(policy)


def test_fast_forwarded_decode_runs_equal_step_by_step_decoding() -> None:
    """Decode runs are fast-forwarded and cut by arrivals; the result must be the engine's,
    step by step: same cache counters, same latencies (to float rounding), same preemptions."""
    workload = with_outputs(synthetic_trace(num_requests=120, rate_per_s=4.0), 200)
    results = []
    for fast in (True, False):
        results.append(run(workload, workers=2, capacity=12_000, block_size=16, profile=H100,
                           policy="cache_aware", fast_forward=fast, max_num_seqs=8))
    fast_run, slow_run = results
    assert fast_run.num_events < slow_run.num_events / 5
    assert fast_run.num_preemptions > 0  # runs are also cut short by block shortage
    assert fast_run.hit_rate == slow_run.hit_rate
    assert fast_run.num_preemptions == slow_run.num_preemptions
    assert fast_run.computed_tokens == slow_run.computed_tokens
    assert [w.evicted_blocks for w in fast_run.workers] == \
        [w.evicted_blocks for w in slow_run.workers]
    assert fast_run.ttfts == pytest.approx(slow_run.ttfts, rel=1e-9, abs=1e-9)
    assert fast_run.makespan_s == pytest.approx(slow_run.makespan_s, rel=1e-9)


def test_a_prompt_longer_than_the_cache_is_rejected_not_hung() -> None:
    workload = synthetic_trace(num_requests=30)
    result = run(workload, capacity=2_000, block_size=16)
    assert result.num_rejected > 0
    assert result.num_ok + result.num_rejected == result.num_requests
    assert result.audit_ok


def test_config_refuses_a_policy_it_cannot_simulate() -> None:
    with pytest.raises(ValueError, match="cannot be simulated"):
        SimConfig(1, WorkerConfig(10), H100, policy="precise")
