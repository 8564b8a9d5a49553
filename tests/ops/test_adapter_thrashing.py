"""The doctor names adapter thrashing (LoRA slots churning while requests wait for one) and
tells it apart from prefix thrashing, on planted fleet states."""

from __future__ import annotations

from kvserve.ops.diagnose import diagnose
from kvserve.ops.findings import Problem
from kvserve.ops.scrape import Metrics
from tests.ops.test_diagnose import W0, W1, observation, problems, worker_metrics


def with_lora(base: Metrics, *, loads: dict[str, float], waiting_for_slot: float,
              running: str = "fin,sql", waiting: str = "ops") -> Metrics:
    """A kvserve worker's page plus its LoRA series (as server/lora_metrics.py writes them)."""
    m = 'model_name="m"'
    lines = [f'kvserve:lora_adapter_loads_total{{{m},adapter="{a}"}} {n}'
             for a, n in loads.items()]
    lines += [f"kvserve:lora_requests_waiting_for_slot {waiting_for_slot}",
              'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",'
              'waiting_lora_adapters=""} 1.7e9',
              f'vllm:lora_requests_info{{max_lora="2",running_lora_adapters="{running}",'
              f'waiting_lora_adapters="{waiting}"}} 1.8e9']
    extra = Metrics.from_text("\n".join(lines) + "\n")
    return Metrics({**base.families, **extra.families}, base.samples + extra.samples)


def healthy_cache(step: int) -> Metrics:
    """Busy, and the prefix cache hits 90% with few evictions."""
    return worker_metrics(held=40, running=4, live=4, allocated=1000 + 100 * step,
                          freed=1200 + 100 * step, evicted=10 + step,
                          queries=10_000 + 1_000 * step, hits=9_000 + 900 * step)


def test_adapter_thrashing_is_named_and_prefix_thrashing_is_not() -> None:
    first = with_lora(healthy_cache(0), loads={"fin": 40, "sql": 40, "ops": 30},
                      waiting_for_slot=3)
    second = with_lora(healthy_cache(1), loads={"fin": 44, "sql": 43, "ops": 34},
                       waiting_for_slot=2)
    report = diagnose([observation(W0, first, second)])
    (finding,) = problems(report, Problem.ADAPTER_THRASHING)
    assert not problems(report, Problem.THRASHING)
    assert "11 LoRA adapters in 5.0s" in finding.evidence[0]
    assert "fin 44, ops 34, sql 43" in finding.evidence[0]
    assert "3 then 2 requests waited" in finding.evidence[0]
    assert any("prefix hit rate 90%" in e for e in finding.evidence)
    assert any("running fin, sql; waiting ops" in e for e in finding.evidence)


def test_prefix_thrashing_is_not_adapter_thrashing() -> None:
    first = with_lora(worker_metrics(allocated=1000, evicted=900, queries=10_000, hits=100),
                      loads={"fin": 5}, waiting_for_slot=0, running="fin", waiting="")
    second = with_lora(worker_metrics(allocated=1100, evicted=990, queries=11_000, hits=105,
                                      finished=20),
                       loads={"fin": 5}, waiting_for_slot=0, running="fin", waiting="")
    report = diagnose([observation(W0, first, second)])
    assert problems(report, Problem.THRASHING)
    assert not problems(report, Problem.ADAPTER_THRASHING)


def test_near_misses_are_not_adapter_thrashing() -> None:
    loads_a, loads_b = {"fin": 40}, {"fin": 50}
    # loads without anybody waiting for a slot: adapters warming into free slots
    warming = [with_lora(healthy_cache(i), loads=loads, waiting_for_slot=0)
               for i, loads in enumerate((loads_a, loads_b))]
    # waiting for a slot without loads: --max-loras is the limit, adapters stay put
    full = [with_lora(healthy_cache(i), loads=loads_a, waiting_for_slot=4) for i in range(2)]
    report = diagnose([observation(W0, *warming), observation(W1, *full)])
    assert not problems(report, Problem.ADAPTER_THRASHING)


def vllm_page(running: str, waiting: str) -> Metrics:
    return Metrics.from_text(
        'vllm:num_requests_running{model_name="m"} 2\n'
        'vllm:num_requests_waiting{model_name="m"} 3\n'
        f'vllm:lora_requests_info{{max_lora="2",running_lora_adapters="{running}",'
        f'waiting_lora_adapters="{waiting}"}} 1.8e9\n')


def test_a_vllm_worker_is_judged_from_lora_requests_info() -> None:
    churning = observation(W0, vllm_page("fin,sql", "ops"), vllm_page("ops,sql", "fin"))
    stable = observation(W1, vllm_page("fin,sql", "ops"), vllm_page("fin,sql", "ops"))
    report = diagnose([churning, stable])
    (finding,) = problems(report, Problem.ADAPTER_THRASHING)
    assert finding.target == W0 and "inferred from vllm:lora_requests_info" in \
        finding.evidence[0]
