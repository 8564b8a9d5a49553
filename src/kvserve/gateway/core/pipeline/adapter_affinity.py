"""The adapter-affinity scorer: where a request's LoRA adapter is already loaded.

A worker runs at most `max_loras` adapters in a batch. A request of an adapter that is running
there joins the batch (no load); one with a slot free costs one load; one whose adapter waits
there for a slot will ride the load those waiting requests already need; elsewhere it waits for
a slot and then evicts another adapter, whose requests load it back later (thrashing, when
tenants of many adapters spread over every worker). The tiers (1.0 / 0.8 / 0.6 / 0) follow the
Gateway API Inference Extension's `lora-affinity` scorer, read from the same metric
(`vllm:lora_requests_info`, which kvserve and vLLM workers both export), and are weighed
against prefix hits and load in one score (`scorers.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvserve.gateway.core.pipeline.base import RouteRequest, WorkerView

DEFAULT_ADAPTER_WEIGHT = 8.0
"""A worker running the request's adapter counts as eight fewer requests of load (or eight
more cached blocks) than one that must load it into a busy slot: measured in the simulator
(docs/benchmarks.md, "Adapter affinity"): at 8 the adapter loads per request of a
many-adapters workload fall to about what lora_affinity alone gets, while the hit rate stays
cache_aware's; weaker weights leave most of the loads, stronger ones pile an adapter's tenants
onto one worker past its batch."""


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
        return [self.adapter_weight * w.adapters.affinity(adapter) if w.adapters is not None
                else 0.0 for w in workers]
