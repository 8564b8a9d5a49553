"""Which part of a LoRA adapter a tensor-parallel rank holds: the base weights' split, applied to
A and B.

A projection's delta is B @ A @ x. Column-parallel projections (q/k/v, gate/up) split their
output rows, so a rank keeps A whole ([r, in]) and the rows of B ([out, r]) that match the base
weight's rows it holds: its heads' (or, with fewer KV heads than ranks, the one KV head its query
heads read) or its intermediate slice, per sub-module, as the fused layout lays the base shards
out. Row-parallel projections (o, down) split their input columns, so a rank keeps the matching
columns of A and B whole: its delta, from its slice of the input, is a partial sum like its base
output, and the layer's one all_reduce completes both (exact by linearity; no extra collective).
Every slice comes from `tensor_slice`, the function that shards the base checkpoint, so the two
can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.model.config import ModelConfig
from kvserve.model.lora.peft_format import module_shapes
from kvserve.model.tensor_parallel import ShardSpec, tensor_slice


@dataclass(frozen=True, slots=True)
class AdapterSharding:
    """How rank `spec.rank` cuts adapters for the model `config` (the checkpoint's full config,
    not the rank's `shard_config`)."""

    config: ModelConfig
    spec: ShardSpec

    def shard(self, module: str, lora_a: torch.Tensor,
              lora_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) of projection `module` as this rank holds them, from the full A [r, in] and
        B [out, r]: views, never copies (the caller copies them into its slot)."""
        in_features, out_features = module_shapes(self.config)[module]
        cut = tensor_slice(f"{module}.weight", [out_features, in_features], self.config,
                           self.spec)
        if cut is None:
            return lora_a, lora_b
        assert not cut.zero, "only a row-parallel bias is zeroed, and adapters have none"
        if cut.dim == 0:  # column-parallel: the base weight's output rows
            return lora_a, lora_b[cut.start : cut.stop]
        return lora_a[:, cut.start : cut.stop], lora_b  # row-parallel: its input columns
