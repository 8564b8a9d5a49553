"""Megatron-style tensor parallelism: which slice of each checkpoint tensor a rank holds.

q/k/v and gate/up are column-parallel (a rank holds its heads' / its intermediate slice's output
rows), o_proj and down_proj row-parallel (the matching input columns; their partial outputs are
summed by an all_reduce after each). KV heads are split across ranks; with fewer KV heads than
ranks each rank holds the one KV head its query heads read (it is replicated on
``world_size // num_kv_heads`` ranks). The rank's model is built from `shard_config` (the same
architecture with the local head and intermediate counts), so the layers and the paged KV cache
need no tensor-parallel code: a rank's cache holds the KV of its own heads, block ids name the
same slot on every rank.

The embedding and lm_head are replicated, not vocab-parallel: every rank looks tokens up
locally (no all_reduce of [tokens, hidden] per step) and only rank 0, which samples, computes
logits (no all_gather of [rows, vocab] per step). The cost is vocab x hidden weights on every
rank, which the small models served here afford; it saves two collectives a step.
A row-parallel bias is added once: ranks other than 0 hold zeros in its place.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvserve.model.config import ModelConfig

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split output rows (dim 0)
_ROW = ("o_proj", "down_proj")  # split input columns (dim 1)


class ShardingError(ValueError):
    """The model cannot be split over this many ranks; the message says which size and why."""


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """This process's place in a tensor-parallel group: `rank` of `world_size`."""

    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ShardingError(f"rank {self.rank} is not in a group of {self.world_size}")


def check_shardable(config: ModelConfig, world_size: int) -> None:
    """Raise ShardingError unless heads, KV heads and the MLP split evenly over `world_size`."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    problems = []
    if heads % world_size:
        problems.append(f"num_attention_heads ({heads}) is not divisible by it")
    if kv_heads >= world_size and kv_heads % world_size:
        problems.append(f"num_key_value_heads ({kv_heads}) is not divisible by it")
    if kv_heads < world_size and world_size % kv_heads:
        problems.append(f"it is not a multiple of num_key_value_heads ({kv_heads}), so KV "
                        "heads cannot be replicated evenly")
    if config.intermediate_size % world_size:
        problems.append(f"intermediate_size ({config.intermediate_size}) is not divisible by it")
    if problems:
        raise ShardingError(f"tensor_parallel_size {world_size} does not fit this model: "
                            + "; ".join(problems) + "; choose a size that divides the heads")


def shard_config(config: ModelConfig, spec: ShardSpec) -> ModelConfig:
    """The architecture one rank runs: its query heads, its KV heads, its MLP slice."""
    if spec.world_size == 1:
        return config
    check_shardable(config, spec.world_size)
    return replace(config,
                   num_attention_heads=config.num_attention_heads // spec.world_size,
                   num_key_value_heads=max(1, config.num_key_value_heads // spec.world_size),
                   intermediate_size=config.intermediate_size // spec.world_size)


@dataclass(frozen=True, slots=True)
class TensorSlice:
    """Rows or columns [start, stop) of a checkpoint tensor along `dim`; `zero`: the rank holds
    zeros instead (a row-parallel bias on ranks other than 0)."""

    dim: int
    start: int
    stop: int
    zero: bool = False


def tensor_slice(name: str, shape: list[int], config: ModelConfig,
                 spec: ShardSpec) -> TensorSlice | None:
    """The slice of checkpoint tensor `name` (full `shape`) that rank `spec.rank` loads; None
    for a replicated tensor (embeddings, norms, lm_head, q/k norms)."""
    if spec.world_size == 1:
        return None
    parts = name.split(".")
    if len(parts) < 2 or parts[-2] not in _COLUMN + _ROW:
        return None
    proj, kind = parts[-2], parts[-1]
    if proj in _ROW:
        if kind == "bias":
            return TensorSlice(0, 0, shape[0], zero=spec.rank != 0)
        size = shape[1] // spec.world_size
        return TensorSlice(1, spec.rank * size, (spec.rank + 1) * size)
    if proj in ("k_proj", "v_proj"):
        return _kv_slice(config, spec)
    size = shape[0] // spec.world_size
    return TensorSlice(0, spec.rank * size, (spec.rank + 1) * size)


def _kv_slice(config: ModelConfig, spec: ShardSpec) -> TensorSlice:
    """The rows of this rank's KV heads: its share, or the one head its query heads read."""
    kv_heads, hd = config.num_key_value_heads, config.head_dim
    if kv_heads >= spec.world_size:
        local = kv_heads // spec.world_size
        first = spec.rank * local
    else:
        local = 1
        first = spec.rank * kv_heads // spec.world_size
    return TensorSlice(0, first * hd, (first + local) * hd)
