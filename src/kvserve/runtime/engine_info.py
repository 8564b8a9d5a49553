"""What a loaded engine is, fixed at load: the values the server, its metrics and /debug read.

The server talks to the engine through `AsyncEngine` only; what it needs to know about the
engine (its name, limits, KV layout) is this one frozen value, built once by `LLMEngine`, so
it is safe to read from any thread and never reaches into the scheduler or the runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvserve.runtime.engine_args import EngineArgs


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What the engine accepts and runs at once (vLLM's names).

    `max_model_len`: prompt + output tokens of one request; `max_num_seqs`: requests in the
    running batch (what a gateway keeps in flight here); `max_num_batched_tokens`: tokens one
    step computes; `num_blocks` x `block_size`: the device KV cache, in tokens.
    """

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_blocks: int

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                     "num_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """The engine's identity and limits. `model_name` is the served name (also the cache's
    model id in block hashes); `model_path` the checkpoint directory; `kv_layout` and
    `kv_payload_bytes` describe one block's KV as disaggregated prefill ships it
    (kvserve.model.kv_export); `args` are the settings it was built from."""

    model_name: str
    model_path: Path | None
    vocab_size: int
    limits: EngineLimits
    kv_layout: str
    kv_payload_bytes: int
    args: EngineArgs
