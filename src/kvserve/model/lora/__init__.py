"""kvserve.model.lora: LoRA adapters in PEFT's format, served many to a batch.

`load_peft_adapter` reads and checks one adapter and digests it; `AdapterSlots` keeps the loaded
ones in fixed slot tensors on the model's device and adds their deltas after the base
projections; `RunnerAdapters` is what the runner calls each step; `AdapterSharding` cuts an
adapter as tensor parallelism cuts the base weights, and `SlotAssignment` is what rank 0's slots
did in a step, which the other ranks follow.
"""

from kvserve.model.lora.peft_format import (
    TARGET_MODULES,
    LoRAFormatError,
    LoRAWeights,
    load_peft_adapter,
    module_shapes,
)
from kvserve.model.lora.runner_hook import RunnerAdapters
from kvserve.model.lora.sharding import AdapterSharding
from kvserve.model.lora.slots import AdapterSlots, SlotAssignment

__all__ = [
    "TARGET_MODULES",
    "AdapterSharding",
    "AdapterSlots",
    "LoRAFormatError",
    "LoRAWeights",
    "RunnerAdapters",
    "SlotAssignment",
    "load_peft_adapter",
    "module_shapes",
]
