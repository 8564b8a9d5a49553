"""LoRA adapters in the simulator: tenants with adapters, and each worker's device slots.

A tenant's requests run under its adapter (`TenantAdapters`: the k-th tenant seen gets adapter
`lora-{k mod num_adapters}`, so several tenants may share one). A simulated worker's engine
admits at most `max_loras` distinct adapters a step (the real scheduler's rule); its model
holds `max_loras` adapters in device slots (`AdapterSlots`, least recently used evicted), and a
step that needs one not in a slot loads it first, `load_s` each (read from host memory or disk
and copied in: the cost that adapter thrashing repeats). The gateway sees each worker's running
and waiting adapters as `vllm:lora_requests_info` says them (`AdapterState`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from kvserve.engine.lora import AdapterRef
from kvserve.kvevents.wire import adapter_name_digest


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """The adapter workload: `num_adapters` adapters over the tenants, `max_loras` slots per
    worker (vLLM's `--max-loras`), `load_s` seconds to load one into a slot."""

    num_adapters: int
    max_loras: int = 2
    load_s: float = 0.05

    def __post_init__(self) -> None:
        if self.num_adapters < 1 or self.max_loras < 1:
            raise ValueError(f"an adapter workload needs --adapters >= 1 and --max-loras >= 1, "
                             f"got {self.num_adapters} and {self.max_loras}")
        if not 0.0 <= self.load_s < float("inf"):
            raise ValueError(f"--adapter-load-ms must be >= 0, got {self.load_s * 1000}")


class TenantAdapters:
    """Each tenant's adapter, assigned in the order tenants first appear; a request with no
    tenant runs on the base model. Identity: sha256 of the name, as the gateway keys it."""

    def __init__(self, spec: AdapterSpec) -> None:
        self.spec = spec
        self._by_tenant: dict[str, AdapterRef] = {}
        self._refs = [AdapterRef(f"lora-{k}", k + 1, adapter_name_digest(f"lora-{k}"))
                      for k in range(spec.num_adapters)]

    def adapter_for(self, tenant: str | None) -> AdapterRef | None:
        if tenant is None:
            return None
        ref = self._by_tenant.get(tenant)
        if ref is None:
            ref = self._by_tenant[tenant] = self._refs[len(self._by_tenant)
                                                       % self.spec.num_adapters]
        return ref


class AdapterSlots:
    """A worker's device slots: at most `num_slots` adapters loaded, least recently used out.
    Counts loads and evictions, as kvserve's `kvserve:lora_adapter_loads` and `_evictions`."""

    def __init__(self, num_slots: int) -> None:
        assert num_slots >= 1
        self.num_slots = num_slots
        self._loaded: OrderedDict[bytes, None] = OrderedDict()
        self.num_loads = 0
        self.num_evictions = 0

    def use(self, digests: Iterable[bytes]) -> int:
        """A step runs these adapters (at most `num_slots`, the scheduler's rule): load the
        missing ones, evicting the least recently used; returns how many were loaded."""
        wanted = list(dict.fromkeys(digests))
        assert len(wanted) <= self.num_slots, "the scheduler admits at most max_loras adapters"
        loaded = self._loaded
        for digest in wanted:  # the step's adapters first, so none evicts another of them
            if digest in loaded:
                loaded.move_to_end(digest)
        num_loads = 0
        for digest in wanted:
            if digest in loaded:
                continue
            if len(loaded) >= self.num_slots:
                loaded.popitem(last=False)
                self.num_evictions += 1
            loaded[digest] = None
            num_loads += 1
        self.num_loads += num_loads
        return num_loads
