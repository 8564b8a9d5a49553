"""Wire LoRA serving into a freshly built engine: the registry, the device slots, the runner."""

from __future__ import annotations

from collections.abc import Callable

from kvserve.model import LoadedModel
from kvserve.model.lora import AdapterSharding, AdapterSlots, RunnerAdapters
from kvserve.model.runner import ModelRunner
from kvserve.runtime.engine_args import EngineArgs
from kvserve.runtime.lora_registry import LoRARegistry


def attach_lora(args: EngineArgs, loaded: LoadedModel, runner: ModelRunner) -> LoRARegistry | None:
    """With `args.enable_lora`: `max_loras` slots of rank `max_lora_rank` on the model's device,
    a registry keeping `max_cpu_loras` adapters in host memory, and the runner applying them.
    None (and the model untouched) without it. Under tensor parallelism this is rank 0: the
    registry checks adapters against the whole model, the slots hold rank 0's shard."""
    if not args.enable_lora:
        return None
    registry = LoRARegistry(loaded.config, loaded.dtype, args.max_lora_rank,
                            args.resolved_max_cpu_loras)
    slots = rank_slots(args, loaded, registry.count_load, registry.count_eviction)
    runner.lora = RunnerAdapters(slots, registry.weights, registry.count_rows)
    registry.slots = slots
    return registry


def rank_slots(args: EngineArgs, loaded: LoadedModel,
               on_load: Callable[[bytes], None] | None = None,
               on_evict: Callable[[bytes], None] | None = None) -> AdapterSlots:
    """The adapter slots of this rank's model (`loaded.shard`), cutting each adapter as its
    base weights are cut; a tensor-parallel rank other than 0 fills them as rank 0 says."""
    sharding = (AdapterSharding(loaded.config, loaded.shard)
                if loaded.shard.world_size > 1 else None)
    return AdapterSlots(loaded.model, args.max_loras, args.max_lora_rank, on_load=on_load,
                        on_evict=on_evict, sharding=sharding)
