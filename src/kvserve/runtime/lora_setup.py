"""Wire LoRA serving into a freshly built engine: the registry, the device slots, the runner."""

from __future__ import annotations

from kvserve.model import LoadedModel
from kvserve.model.lora import AdapterSlots, RunnerAdapters
from kvserve.model.runner import ModelRunner
from kvserve.runtime.engine_args import EngineArgs
from kvserve.runtime.lora_registry import LoRARegistry


def attach_lora(args: EngineArgs, loaded: LoadedModel, runner: ModelRunner) -> LoRARegistry | None:
    """With `args.enable_lora`: `max_loras` slots of rank `max_lora_rank` on the model's device,
    a registry keeping `max_cpu_loras` adapters in host memory, and the runner applying them.
    None (and the model untouched) without it."""
    if not args.enable_lora:
        return None
    registry = LoRARegistry(loaded.config, loaded.dtype, args.max_lora_rank,
                            args.resolved_max_cpu_loras)
    slots = AdapterSlots(loaded.model, args.max_loras, args.max_lora_rank,
                         on_load=registry.count_load, on_evict=registry.count_eviction)
    runner.lora = RunnerAdapters(slots, registry.weights, registry.count_rows)
    registry.slots = slots
    return registry
