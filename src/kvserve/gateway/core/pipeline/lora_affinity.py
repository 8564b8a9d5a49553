"""Adapter affinity alone, with load: the field's LoRA-aware router, kept for comparison."""

from __future__ import annotations

from kvserve.gateway.core.pipeline.adapter_affinity import (
    DEFAULT_ADAPTER_WEIGHT,
    AdapterAffinity,
    AdapterOrder,
)
from kvserve.gateway.core.pipeline.base import Branch
from kvserve.gateway.core.pipeline.filters import Healthy
from kvserve.gateway.core.pipeline.pickers import BestScore
from kvserve.gateway.core.pipeline.pipeline import Pipeline
from kvserve.gateway.core.pipeline.rendezvous import DEFAULT_PREFIX_BLOCKS, RendezvousOrder
from kvserve.gateway.core.pipeline.scorers import DEFAULT_LOAD_WEIGHT, Load, check_weights


class LoRAAffinityPolicy(Pipeline):
    """Healthy -> adapter order (`AdapterOrder`) -> adapter affinity and load, weighted -> the
    best score.
    No prefix index: where a request's adapter runs, not what is cached, decides (as a router
    built on the `lora-affinity` and queue scorers alone does); `cache_aware` and `precise`
    weigh the same scorer against prefix hits. Ties keep the adapter's order, so replicas
    agree while loads are equal."""

    name = "lora_affinity"
    replica_safe = True  # the workers' scraped adapters, and a shared order for ties

    def __init__(self, *, adapter_weight: float = DEFAULT_ADAPTER_WEIGHT,
                 load_weight: float = DEFAULT_LOAD_WEIGHT) -> None:
        check_weights(1.0, load_weight)
        self.adapter_weight = adapter_weight
        self.load_weight = load_weight
        super().__init__(
            filters=[Healthy()],
            order=AdapterOrder(RendezvousOrder(DEFAULT_PREFIX_BLOCKS)),
            scorers=[AdapterAffinity(adapter_weight), Load(load_weight)],
            picker=BestScore(Branch.AFFINITY),
        )
