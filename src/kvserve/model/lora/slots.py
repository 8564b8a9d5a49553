"""Loaded adapter slots: fixed tensors on the model's device, filled from host memory, LRU.

`AdapterSlots` owns `max_loras` slots per layer and projection (see punica.py for the layout)
and attaches a `LoRALayer` to every attention and MLP module, which adds the deltas of the
step's adapters after the base matmuls. The runner tells it each step which adapters run
(`begin_step`): adapters not loaded are copied in over the least recently used slots that the
step does not need. The scheduler admits at most `max_loras` distinct adapters a step, so the
step's adapters always fit.

Under tensor parallelism every rank has its own slots, sized for its shard of the model and
filled with its shard of each adapter (`AdapterSharding`). Rank 0 decides: `begin_step` returns
a `SlotAssignment` (each sequence's slot and the adapters it copied in), which travels with the
step's plan, and the other ranks `follow` it, so the same slot holds the same adapter on every
rank and evictions happen in lockstep.
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
from kvserve.model.lora.sharding import AdapterSharding

GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
          "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
"""Fused projection -> its sub-modules, in the order of the fused output's columns."""


@dataclass(slots=True)
class StepAdapters:
    """The current step's adapter rows by slot, shared by every layer (set by `begin_step`)."""

    segments: Segments = field(default_factory=lambda: Segments(slice(0, 0), ()))


@dataclass(frozen=True, slots=True)
class SlotLoad:
    """`weights` (the whole adapter, in host memory) were copied into `slot` this step."""

    slot: int
    weights: LoRAWeights


@dataclass(frozen=True, slots=True)
class SlotAssignment:
    """What one step did to the slots: `seq_slots[i]` is sequence i's slot (-1: the base
    model), `loads` the adapters copied in first (each over whatever the slot held). It is
    all another rank needs to hold the same adapters in the same slots."""

    seq_slots: tuple[int, ...]
    loads: tuple[SlotLoad, ...] = ()


class LoRALayer:
    """One decoder layer's adapter slots. `add(kind, x, outs)` adds the step's deltas into the
    output slices `outs` of the fused projection `kind` computed from input x [T, in].
    `config` is the architecture this rank runs (its shard's); `sharding` cuts each adapter
    to it (None: one rank, adapters whole)."""

    def __init__(self, config: ModelConfig, num_slots: int, rank: int, dtype: torch.dtype,
                 device: torch.device, step: StepAdapters,
                 sharding: AdapterSharding | None = None) -> None:
        shapes = module_shapes(config)
        self.rank, self.step, self.sharding = rank, step, sharding
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
                if self.sharding is not None:
                    lora_a, lora_b = self.sharding.shard(sub, lora_a, lora_b)
                r = lora_a.shape[0]
                self.a[kind][slot, m * self.rank : m * self.rank + r].copy_(lora_a)
                b[:, :r].copy_(lora_b)
                found = True
            (self.used[kind].add if found else self.used[kind].discard)(slot)


class AdapterSlots:
    """`max_loras` slots on the model's device, keyed by adapter digest, least recently used
    first. `on_load(digest)` / `on_evict(digest)` let the owner count loads and evictions.
    `sharding`: the model is a tensor-parallel rank's shard and so is every adapter copied in."""

    def __init__(self, model: LlamaForCausalLM, max_loras: int, max_rank: int,
                 on_load: Callable[[bytes], None] | None = None,
                 on_evict: Callable[[bytes], None] | None = None, *,
                 sharding: AdapterSharding | None = None) -> None:
        param = next(model.parameters())
        self.max_loras, self.max_rank = max_loras, max_rank
        self.device = param.device
        self.step = StepAdapters()
        self.layers = [LoRALayer(model.config, max_loras, max_rank, param.dtype, param.device,
                                 self.step, sharding) for _ in model.model.layers]
        for layer, lora in zip(model.model.layers, self.layers, strict=True):
            assert isinstance(layer, DecoderLayer)
            layer.self_attn.lora = lora
            layer.mlp.lora = lora
        self.slot_of: OrderedDict[bytes, int] = OrderedDict()  # digest -> slot, LRU first
        self._on_load, self._on_evict = on_load, on_evict

    def begin_step(self, seq_digests: Sequence[bytes | None], query_start: Sequence[int],
                   fetch: Callable[[bytes], LoRAWeights]) -> SlotAssignment:
        """Load the step's adapters (sequence i runs the adapter of digest `seq_digests[i]`;
        None: the base model; `fetch(digest)` gives the weights of one not loaded) and group
        its rows by slot. Returns what it did, for other ranks to `follow`."""
        needed = list(dict.fromkeys(d for d in seq_digests if d is not None))
        if len(needed) > self.max_loras:
            raise ValueError(f"a step runs {len(needed)} adapters but --max-loras is "
                             f"{self.max_loras}: the scheduler must not admit more")
        # Fetch everything before touching a slot: a fetch that raises (files changed on disk)
        # leaves the slots as they were, so ranks following these loads never miss one.
        fetched = {d: fetch(d) for d in needed if d not in self.slot_of}
        loads = []
        for digest in needed:
            if digest in self.slot_of:
                self.slot_of.move_to_end(digest)
                continue
            slot = self._free_slot(set(needed))
            self._install(slot, fetched[digest])
            loads.append(SlotLoad(slot, fetched[digest]))
            if self._on_load is not None:
                self._on_load(digest)
        seq_slots = tuple(-1 if d is None else self.slot_of[d] for d in seq_digests)
        self.step.segments = slot_segments(seq_slots, query_start, self.device)
        return SlotAssignment(seq_slots, tuple(loads))

    def follow(self, assignment: SlotAssignment, query_start: Sequence[int]) -> None:
        """Do what another rank's `begin_step` did (its loads into the same slots, evicting
        what they held) and group this step's rows as it did."""
        for load in assignment.loads:
            for digest in [d for d, slot in self.slot_of.items() if slot == load.slot]:
                del self.slot_of[digest]
            self._install(load.slot, load.weights)
        self.step.segments = slot_segments(assignment.seq_slots, query_start, self.device)

    def end_step(self) -> None:
        self.step.segments = Segments(slice(0, 0), ())

    def drop(self, digest: bytes) -> None:
        """Forget an adapter's slot (unloaded): the slot is reused by the next load."""
        self.slot_of.pop(digest, None)

    def _install(self, slot: int, weights: LoRAWeights) -> None:
        """Copy `weights` (this rank's shard of them) into `slot`, most recently used."""
        for i, layer in enumerate(self.layers):
            layer.write(slot, i, weights)
        self.slot_of[weights.digest] = slot
        self.slot_of.move_to_end(weights.digest)

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
