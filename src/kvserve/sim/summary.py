"""Turn a finished simulation into a `SimResult`, auditing every worker's cache on the way."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.percentiles import percentile
from kvserve.sim.client import Outcome
from kvserve.sim.metrics import SimResult, WorkerSummary

if TYPE_CHECKING:
    from kvserve.sim.fleet import FleetSimulator


def summarise(sim: FleetSimulator, wall_s: float) -> SimResult:
    """Figures of a run that has drained. Every worker must be idle; its cache is audited
    (`check_idle`: all invariants, and zero blocks held with no live request)."""
    config = sim.config
    makespan = max(sim.events.now, 1e-9)
    gateway = sim.gateway
    assert gateway.num_in_flight == 0 and not any(gateway.in_flight.values()), \
        "the gateway still counts requests in flight after the run drained"
    assert not any(gateway.backlog_tokens.values()), \
        f"the gateway still counts prefill backlog after the run drained: {gateway.backlog_tokens}"
    workers: list[WorkerSummary] = []
    for worker_id, worker in sim.workers.items():
        assert worker.is_idle, f"{worker_id} still has work after the run drained"
        report = worker.kv.check_idle()
        stats = worker.kv.stats()
        c = worker.counters
        workers.append(WorkerSummary(
            worker_id=worker_id,
            routed=sim.gateway.routed_by_worker[worker_id],
            utilization=c.busy_s / makespan,
            steps=c.num_steps,
            preemptions=worker.num_preemptions,
            computed_tokens=c.computed_tokens,
            wasted_tokens=c.wasted_tokens,
            hit_rate=stats.hit_rate,
            queried_tokens=stats.counters.prefix_queries_tokens,
            evicted_blocks=stats.counters.evicted_blocks,
            audit_ok=report.ok,
            held_blocks_at_end=stats.num_held_blocks,
            adapter_loads=worker.num_adapter_loads,
        ))
    queries = sum(w.kv.counters.prefix_queries_tokens for w in sim.workers.values())
    hits = sum(w.kv.counters.prefix_hits_tokens for w in sim.workers.values())
    ok = [c for c in sim.clients if c.outcome is Outcome.OK]
    ttfts = [t for c in ok if (t := c.ttft) is not None]
    e2es = [t for c in ok if (t := c.e2e) is not None]
    within_slo = sum(1 for c in sim.clients if (t := c.ttft) is not None and t <= config.slo_s)
    utilizations = [w.utilization for w in workers]
    output_tokens = sum(max(1, c.trace.output_length) for c in ok)
    total = len(sim.clients)
    return SimResult(
        label=sim.label,
        policy=config.policy,
        workload=sim.workload.name,
        profile=config.profile.name,
        num_workers=config.num_workers,
        capacity_tokens=config.worker.num_blocks * config.worker.block_size,
        retries=config.client.max_retries > 0,
        backpressure=config.backpressure is not None,
        num_requests=total,
        num_ok=len(ok),
        num_gave_up=sum(1 for c in sim.clients if c.outcome is Outcome.GAVE_UP),
        num_rejected=sum(1 for c in sim.clients if c.outcome is Outcome.REJECTED),
        hit_rate=hits / queries if queries else 0.0,
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        e2e_p50=percentile(e2es, 50),
        e2e_p99=percentile(e2es, 99),
        slo_s=config.slo_s,
        slo_attainment=within_slo / total if total else 0.0,
        requests_per_s=len(ok) / makespan,
        output_tokens_per_s=output_tokens / makespan,
        utilization_mean=sum(utilizations) / len(utilizations),
        utilization_max=max(utilizations),
        num_preemptions=sum(w.preemptions for w in workers),
        num_retries=sum(c.num_retries for c in sim.clients),
        num_throttled=sim.gateway.num_throttled,
        num_attempts=sim.gateway.num_routed,
        computed_tokens=sum(w.computed_tokens for w in workers),
        wasted_tokens=sum(w.wasted_tokens for w in workers),
        makespan_s=makespan,
        wall_s=wall_s,
        num_events=sim.events.num_events,
        audit_ok=all(w.audit_ok and w.held_blocks_at_end == 0 for w in workers),
        adapter_loads=sum(w.adapter_loads for w in workers),
        adapter_loads_per_request=(sum(w.adapter_loads for w in workers) / len(ok)
                                   if ok else 0.0),
        workers=workers,
        ttfts=ttfts,
        timeline=sim.timeline,
    )
