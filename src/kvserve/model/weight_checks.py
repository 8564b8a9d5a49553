"""The strict-loading checks every checkpoint format shares: each parameter's expected shape on
this rank, and one error that lists every missing, unexpected and mis-shaped tensor at once (so
a user fixes a checkpoint in one round, not one tensor at a time)."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.model.config import ModelConfig
from kvserve.model.errors import ModelLoadError
from kvserve.model.tensor_parallel import ShardSpec, TensorSlice, tensor_slice

MAX_LISTED = 12


def rank_shape(name: str, shape: Sequence[int], config: ModelConfig | None,
               shard: ShardSpec) -> tuple[list[int], TensorSlice | None]:
    """The shape this rank loads of parameter `name` stored as `shape`, and the slice it takes
    (None: the whole tensor; no `config`: no sharding)."""
    rank = list(shape)
    part = None if config is None else tensor_slice(name, rank, config, shard)
    if part is not None and not part.zero:
        rank[part.dim] = part.stop - part.start
    return rank, part


def raise_on_mismatch(what: str, missing: Sequence[str], unexpected: Sequence[str],
                      mismatched: Sequence[str]) -> None:
    """ModelLoadError naming every problem, prefixed by `what`; nothing when all lists are
    empty."""
    problems = []
    if missing:
        problems.append(f"missing tensors: {listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {listing(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches: {listing(mismatched)}")
    if problems:
        raise ModelLoadError(f"{what}: " + "; ".join(problems))


def listing(items: Sequence[str]) -> str:
    """At most MAX_LISTED items, then how many more."""
    shown = ", ".join(items[:MAX_LISTED])
    return shown + (f" and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else "")
