"""Loaded adapter slots: fixed tensors on the model's device, filled from host memory, LRU.

`AdapterSlots` owns `max_loras` slots per layer and projection (see punica.py for the layout)
and attaches a `LoRALayer` to every attention and MLP module, which adds the deltas of the
step's adapters after the base matmuls. The runner tells it each step which adapters run
(`begin_step`): adapters not loaded are copied in over the least recently used slots that the
step does not need. The scheduler admits at most `max_loras` distinct adapters a step, so the
step's adapters always fit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvserve.model.config import ModelConfig
from kvserve.model.llama import DecoderLayer, LlamaForCausalLM
from kvserve.model.lora.peft_format import LoRAWeights, module_shapes
from kvserve.model.lora.punica import Segments, sgmv_add, slot_segments

GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
          "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
"""Fused projection -> its sub-modules, in the order of the fused output's columns."""


@dataclass(slots=True)
class StepAdapters:
    """The current step's adapter rows by slot, shared by every layer (set by `begin_step`)."""

    segments: Segments = field(default_factory=lambda: Segments(slice(0, 0), ()))


class LoRALayer:
    """One decoder layer's adapter slots. `add(kind, x, outs)` adds the step's deltas into the
    output slices `outs` of the fused projection `kind` computed from input x [T, in]."""

    def __init__(self, config: ModelConfig, num_slots: int, rank: int, dtype: torch.dtype,
                 device: torch.device, step: StepAdapters) -> None:
        shapes = module_shapes(config)
        self.rank, self.step = rank, step
        self.a: dict[str, torch.Tensor] = {}  # kind -> [S, n * R, in]
        self.b: dict[str, list[torch.Tensor]] = {}  # kind -> per sub-module [S, out_m, R]
        for kind, subs in GROUPS.items():
            in_features = shapes[subs[0]][0]
            self.a[kind] = torch.zeros(num_slots, len(subs) * rank, in_features, dtype=dtype,
                                       device=device)
            self.b[kind] = [torch.zeros(num_slots, shapes[s][1], rank, dtype=dtype,
                                        device=device) for s in subs]
        self.used: dict[str, set[int]] = {kind: set() for kind in GROUPS}  # slots with weights

    def add(self, kind: str, x: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
        """outs[m] [T, out_m] += this step's adapter deltas of x [T, in] (base rows unchanged)."""
        segments = self.step.segments
        if segments.spans and not segments.slots.isdisjoint(self.used[kind]):
            sgmv_add(x, self.a[kind], self.b[kind], outs, segments, self.rank)

    def write(self, slot: int, layer: int, weights: LoRAWeights) -> None:
        """Copy `weights`' modules of this layer into `slot` (zeros where it has none)."""
        for kind, subs in GROUPS.items():
            self.a[kind][slot].zero_()
            found = False
            for m, sub in enumerate(subs):
                b = self.b[kind][m][slot]
                b.zero_()
                pair = weights.modules.get((layer, sub))
                if pair is None:
                    continue
                lora_a, lora_b = pair  # [r, in], [out, r]
                r = lora_a.shape[0]
                self.a[kind][slot, m * self.rank : m * self.rank + r].copy_(lora_a)
                b[:, :r].copy_(lora_b)
                found = True
            (self.used[kind].add if found else self.used[kind].discard)(slot)


class AdapterSlots:
    """`max_loras` slots on the model's device, keyed by adapter digest, least recently used
    first. `on_load(digest)` / `on_evict(digest)` let the owner count loads and evictions."""

    def __init__(self, model: LlamaForCausalLM, max_loras: int, max_rank: int,
                 on_load: Callable[[bytes], None] | None = None,
                 on_evict: Callable[[bytes], None] | None = None) -> None:
        param = next(model.parameters())
        self.max_loras, self.max_rank = max_loras, max_rank
        self.device = param.device
        self.step = StepAdapters()
        self.layers = [LoRALayer(model.config, max_loras, max_rank, param.dtype, param.device,
                                 self.step) for _ in model.model.layers]
        for layer, lora in zip(model.model.layers, self.layers, strict=True):
            assert isinstance(layer, DecoderLayer)
            layer.self_attn.lora = lora
            layer.mlp.lora = lora
        self.slot_of: OrderedDict[bytes, int] = OrderedDict()  # digest -> slot, LRU first
        self._on_load, self._on_evict = on_load, on_evict

    def begin_step(self, seq_digests: Sequence[bytes | None], query_start: Sequence[int],
                   fetch: Callable[[bytes], LoRAWeights]) -> list[int]:
        """Load the step's adapters (sequence i runs the adapter of digest `seq_digests[i]`;
        None: the base model; `fetch(digest)` gives the weights of one not loaded) and group
        its rows by slot. Returns each sequence's slot (-1: the base model)."""
        needed = list(dict.fromkeys(d for d in seq_digests if d is not None))
        if len(needed) > self.max_loras:
            raise ValueError(f"a step runs {len(needed)} adapters but --max-loras is "
                             f"{self.max_loras}: the scheduler must not admit more")
        for digest in needed:
            if digest in self.slot_of:
                self.slot_of.move_to_end(digest)
                continue
            weights = fetch(digest)
            self.slot_of[digest] = slot = self._free_slot(set(needed))
            for i, layer in enumerate(self.layers):
                layer.write(slot, i, weights)
            if self._on_load is not None:
                self._on_load(digest)
        seq_slots = [-1 if d is None else self.slot_of[d] for d in seq_digests]
        self.step.segments = slot_segments(seq_slots, query_start, self.device)
        return seq_slots

    def end_step(self) -> None:
        self.step.segments = Segments(slice(0, 0), ())

    def drop(self, digest: bytes) -> None:
        """Forget an adapter's slot (unloaded): the slot is reused by the next load."""
        self.slot_of.pop(digest, None)

    def _free_slot(self, needed: set[bytes]) -> int:
        taken = set(self.slot_of.values())
        for slot in range(self.max_loras):
            if slot not in taken:
                return slot
        victim = next(d for d in self.slot_of if d not in needed)  # LRU not in this step
        slot = self.slot_of.pop(victim)
        if self._on_evict is not None:
            self._on_evict(victim)
        return slot
