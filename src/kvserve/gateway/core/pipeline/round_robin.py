"""Round robin over the healthy workers: the baseline that thrashes prefix caches."""

from __future__ import annotations

from kvserve.gateway.core.pipeline.filters import Healthy
from kvserve.gateway.core.pipeline.pickers import Rotation
from kvserve.gateway.core.pipeline.pipeline import Pipeline


class RoundRobinPolicy(Pipeline):
    """Healthy -> rotation in id order. Two instances fed the same calls agree; replicas
    behind a balancer do not (each keeps its own counter)."""

    name = "round_robin"
    replica_safe = True  # no index: nothing replicas could learn apart

    def __init__(self) -> None:
        super().__init__(filters=[Healthy()], picker=Rotation())
