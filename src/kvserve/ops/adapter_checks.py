"""Adapter thrashing on one worker: LoRA adapters evicted and loaded again while requests wait
for a slot. Pure, like the other checks: an `Observation` in, findings out.

Told apart from prefix thrashing (worker_checks.check_thrashing) by what churns: there, cached
prefix blocks are evicted before reuse and the hit rate falls; here, the worker's `--max-loras`
adapter slots are, and the prefix hit rate may stay high. On a kvserve worker the evidence is
its counters (`kvserve:lora_adapter_loads_total` across the window and
`kvserve:lora_requests_waiting_for_slot` in both snapshots); vLLM exports no load counter, so
on a vLLM worker it is inferred from `vllm:lora_requests_info`: every slot busy with requests
of other adapters waiting, in both snapshots, and a different set running in the second.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.ops.findings import Finding, Problem, Severity
from kvserve.ops.scrape import Metrics, Observation
from kvserve.ops.worker_checks import delta, hit_rates

ADAPTER_LOADS_PER_S = 0.2
"""Loads a second (one every five seconds) that, with requests waiting for a slot, name
adapter thrashing: a fleet that keeps each adapter where it runs loads one only when a tenant
starts. The alert KVServeLoRAAdapterThrashing uses the same threshold."""
MIN_LOADS = 3  # a short window with a load or two is a tenant starting, not churn
LORA_INFO = "vllm:lora_requests_info"
WAITING_FOR_SLOT = "kvserve:lora_requests_waiting_for_slot"


@dataclass(frozen=True, slots=True)
class _Slots:
    max_loras: int
    running: frozenset[str]
    waiting: frozenset[str]

    @property
    def is_contended(self) -> bool:
        """Every slot runs an adapter while requests of other adapters wait."""
        return len(self.running) >= self.max_loras and bool(self.waiting - self.running)


def _names(value: str) -> frozenset[str]:
    return frozenset(n for n in (part.strip() for part in value.split(",")) if n)


def lora_slots(metrics: Metrics | None) -> _Slots | None:
    """The latest `vllm:lora_requests_info` sample (the largest value: when its label set was
    last current), None without one."""
    if metrics is None:
        return None
    samples = [(v, lab) for n, lab, v in metrics.samples if n == LORA_INFO]
    if not samples:
        return None
    _, labels = max(samples, key=lambda s: s[0])
    max_lora = labels.get("max_lora", "")
    if not max_lora.isdigit():
        return None
    return _Slots(int(max_lora), _names(labels.get("running_lora_adapters", "")),
                  _names(labels.get("waiting_lora_adapters", "")))


def check_adapter_thrashing(obs: Observation) -> list[Finding]:
    """Adapter loads fast while requests wait for a slot (module doc)."""
    a, b = obs.first.metrics, obs.second.metrics
    if a is None or b is None:
        return []
    dt = obs.interval_s
    before, after = lora_slots(a), lora_slots(b)
    evidence: list[str] = []
    if b.has(WAITING_FOR_SLOT):
        loads = delta(obs, "kvserve:lora_adapter_loads_total")
        wait_a, wait_b = a.value(WAITING_FOR_SLOT), b.value(WAITING_FOR_SLOT)
        if loads < MIN_LOADS or loads / dt < ADAPTER_LOADS_PER_S or min(wait_a, wait_b) < 1:
            return []
        by_adapter = ", ".join(f"{k} {v:.0f}" for k, v in sorted(
            b.by_label("kvserve:lora_adapter_loads_total", "adapter").items()) if v > 0)
        evidence.append(f"loaded {loads:.0f} LoRA adapters in {dt:.1f}s ({loads / dt:.2f}/s; "
                        f"loads since start by adapter: {by_adapter}) while {wait_a:.0f} then "
                        f"{wait_b:.0f} requests waited for an adapter slot")
    elif (before is not None and after is not None and before.is_contended
          and after.is_contended and before.running != after.running):
        evidence.append(f"all {after.max_loras} adapter slots busy in both snapshots with "
                        f"{', '.join(sorted(after.waiting - after.running))} waiting, and the "
                        f"running adapters changed ({', '.join(sorted(before.running))} -> "
                        f"{', '.join(sorted(after.running))}): vLLM exports no load counter, "
                        "so this is inferred from vllm:lora_requests_info")
    else:
        return []
    if after is not None:
        evidence.append(f"--max-loras {after.max_loras}; running "
                        f"{', '.join(sorted(after.running)) or 'none'}; waiting "
                        f"{', '.join(sorted(after.waiting)) or 'none'}")
    window, _ = hit_rates(obs)
    if window is not None:
        evidence.append(f"prefix hit rate {window:.0%} in the window: the adapter slots churn, "
                        "not (only) the prefix cache")
    evidence.append("more adapters reach this worker at once than it has slots: route by "
                    "adapter affinity (cache_aware/precise with adapter_weight > 0), map "
                    "tenants to adapters at the gateway (--tenant-adapter), or raise "
                    "--max-loras")
    return [Finding(obs.url, Problem.ADAPTER_THRASHING, Severity.WARNING,
                    "LoRA adapter thrashing: adapters are evicted and loaded again while "
                    "requests wait for a slot", tuple(evidence))]
