"""A request's LoRA adapter as the engine sees it: a name for people, a digest for the cache.

Pure Python. The scheduler counts distinct adapters per step by `digest` (`--max-loras`); the
KV cache keys the adapter's blocks by `digest` (sha256 of its weights and config), never by
`name` or `int_id`, so reloading a name with other weights or two ids of one adapter can never
share the wrong blocks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """`name`: what the client asked for (the request's `model`); `int_id`: vLLM's
    `lora_int_id` (reported, never used as identity); `digest`: 32 bytes, the identity."""

    name: str
    int_id: int
    digest: bytes

    def __post_init__(self) -> None:
        if len(self.digest) != 32:
            raise ValueError(f"an adapter digest is 32 bytes (sha256), got {len(self.digest)}")
