"""The adapter-affinity scorer: where a request's LoRA adapter is already loaded.

A worker runs at most `max_loras` adapters in a batch. A request of an adapter that is running
there joins the batch (no load); one with a slot free costs one load; one whose adapter waits
there for a slot will ride the load those waiting requests already need; elsewhere it waits for
a slot and then evicts another adapter, whose requests load it back later (thrashing, when
tenants of many adapters spread over every worker). The tiers (1.0 / 0.8 / 0.6 / 0) follow the
Gateway API Inference Extension's `lora-affinity` scorer, read from the same metric
(`vllm:lora_requests_info`, which kvserve and vLLM workers both export), and are weighed
against prefix hits and load in one score (`scorers.py`).

The signal is thin where traffic is light: the metric names the adapters of running requests,
not those loaded and idle, so an adapter nobody runs this second has a free-slot tie on most
workers. `AdapterOrder` breaks such ties alike on every replica: a request under an adapter
ranks workers by its tier first, then in the adapter's own rendezvous order, so the adapter's
tenants gather on the same workers (and a prefix nobody holds is placed there, under the load
bound) instead of scattering by their prefixes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from kvserve.gateway.core.pipeline.base import RouteRequest, WorkerView
from kvserve.gateway.core.pipeline.pipeline import Order
from kvserve.gateway.core.pipeline.rendezvous import rendezvous_order

_ADAPTER_DOMAIN = b"kvserve.gateway.adapter-rendezvous.v1"

DEFAULT_ADAPTER_WEIGHT = 8.0
"""A worker running the request's adapter counts as eight requests of load (or eight cached
blocks) more than one that must load it into a busy slot. Measured in the simulator
(docs/benchmarks.md, "Adapter affinity": 16 tenants over 8 adapters, 4 workers, 2 slots each):
from 2 to 8 the loads per request are the same (the tier order does most of the work) and the
hit rate is prefix-only routing's; at 16 and 32 a few more loads are saved at 6 requests/s but
hits are lost, as requests leave cached prefixes for their adapter.
"""


def check_adapter_weight(adapter_weight: float) -> None:
    """Raise ValueError unless `adapter_weight` is >= 0 and finite (0: no adapter affinity)."""
    if not 0.0 <= adapter_weight < float("inf"):
        raise ValueError(f"adapter_weight must be >= 0 and finite, got {adapter_weight}")


class AdapterAffinity:
    """`adapter_weight` times the worker's tier for the request's adapter
    (`AdapterState.affinity`); 0 for a base-model request and for a worker that reports no
    adapters."""

    def __init__(self, adapter_weight: float) -> None:
        check_adapter_weight(adapter_weight)
        self.adapter_weight = adapter_weight

    def score(self, request: RouteRequest, workers: Sequence[WorkerView],
              hits: Mapping[str, int]) -> list[float]:
        adapter = request.adapter
        if adapter is None:
            return [0.0] * len(workers)
        return [self.adapter_weight * adapter_tier(w, adapter) for w in workers]


def adapter_tier(worker: WorkerView, adapter: str) -> float:
    """The worker's affinity tier for `adapter` (0 when it reports no adapters)."""
    return worker.adapters.affinity(adapter) if worker.adapters is not None else 0.0


class AdapterOrder:
    """Pipeline order: a request under an adapter ranks the candidates by affinity tier, then
    in the adapter's rendezvous order (module doc); any other request in `fallback`'s."""

    def __init__(self, fallback: Order) -> None:
        self.fallback = fallback

    def order(self, request: RouteRequest, workers: Sequence[WorkerView]) -> list[WorkerView]:
        adapter = request.adapter
        if adapter is None:
            return self.fallback.order(request, workers)
        key = hashlib.sha256(_ADAPTER_DOMAIN + adapter.encode("utf-8", "surrogatepass")).digest()
        ranked = rendezvous_order(key, workers)
        return sorted(ranked, key=lambda w: -adapter_tier(w, adapter))  # stable within a tier
