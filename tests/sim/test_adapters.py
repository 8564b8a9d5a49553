"""The simulator's adapter workload: slots, loads, and what adapter affinity saves."""

from __future__ import annotations

import pytest

from kvserve.sim import SimResult
from kvserve.sim.adapters import AdapterSlots, AdapterSpec, TenantAdapters
from kvserve.sim.workload import MULTI_TENANT, load_workload
from kvserve.workload import MultiTenantSpec
from tests.sim.helpers import H100, run


def test_slots_load_what_is_missing_and_evict_the_least_recently_used() -> None:
    slots = AdapterSlots(2)
    assert slots.use([b"a", b"b"]) == 2
    assert slots.use([b"a"]) == 0
    assert slots.use([b"c"]) == 1  # evicts b, the least recently used
    assert slots.use([b"a", b"c"]) == 0
    assert slots.use([b"b", b"a"]) == 1  # evicts c; a stays, being used by this very step
    assert (slots.num_loads, slots.num_evictions) == (4, 2)


def test_tenants_share_adapters_in_order_of_appearance() -> None:
    tenants = TenantAdapters(AdapterSpec(2))
    names = [tenants.adapter_for(t) for t in ("x", "y", "z", "x")]
    assert [ref.name if ref else None for ref in names] == ["lora-0", "lora-1", "lora-0",
                                                            "lora-0"]
    assert tenants.adapter_for(None) is None
    with pytest.raises(ValueError, match="--max-loras"):
        AdapterSpec(4, max_loras=0)


def lora_run(policy: str) -> SimResult:
    """16 tenants over 8 adapters, 4 workers of 2 slots each: enough slots fleet-wide, if each
    worker runs its own adapters."""
    workload = load_workload(MULTI_TENANT, spec=MultiTenantSpec(
        num_tenants=16, num_requests=240, prefix_tokens=(1000, 2000), suffix_tokens=(100, 300),
        output_tokens=30, rate_per_s=12.0, skew=0.0, seed=0))
    name, _, option = policy.partition("@")
    options = {} if not option else {"adapter_weight": float(option.split("=")[1])}
    return run(workload, workers=4, capacity=400_000, profile=H100, policy=name,
               policy_options=options, adapters=AdapterSpec(8, max_loras=2, load_s=0.05))


def test_adapter_affinity_loads_fewer_adapters_than_prefix_only_routing() -> None:
    prefix_only = lora_run("cache_aware@adapter_weight=0")
    with_affinity = lora_run("cache_aware")
    for result in (prefix_only, with_affinity):
        assert result.audit_ok and result.num_ok == result.num_requests
    assert prefix_only.adapter_loads_per_request > 0.1
    assert with_affinity.adapter_loads_per_request < prefix_only.adapter_loads_per_request / 3
    assert with_affinity.hit_rate >= prefix_only.hit_rate - 0.01
    assert with_affinity.adapter_loads == sum(w.adapter_loads for w in with_affinity.workers)


def test_without_adapters_nothing_is_loaded() -> None:
    workload = load_workload(MULTI_TENANT, spec=MultiTenantSpec(
        num_tenants=4, num_requests=40, prefix_tokens=(500, 600), suffix_tokens=(50, 60),
        output_tokens=5, rate_per_s=20.0, seed=1))
    result = run(workload, workers=2, capacity=200_000, profile=H100, policy="cache_aware")
    assert result.adapter_loads == 0 and result.adapter_loads_per_request == 0.0
