"""Least load by the power of two choices: two random healthy workers, the less loaded wins."""

from __future__ import annotations

import random

from kvserve.gateway.core.pipeline.filters import Healthy
from kvserve.gateway.core.pipeline.pickers import TwoChoices
from kvserve.gateway.core.pipeline.pipeline import Pipeline


class LeastLoadPolicy(Pipeline):
    """Healthy -> two choices (`pickers.TwoChoices`). The RNG is injected (`rng`, or a
    `seed`), so a seeded run is reproducible."""

    name = "least_load"
    replica_safe = True  # no index: nothing replicas could learn apart

    def __init__(self, *, rng: random.Random | None = None, seed: int = 0) -> None:
        super().__init__(filters=[Healthy()],
                         picker=TwoChoices(rng if rng is not None else random.Random(seed)))
