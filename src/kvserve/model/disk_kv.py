"""The disk tier's KV tensors: the host tier's slot layout, memory-mapped from one file.

`allocate_disk_kv_caches` maps a file of exactly the tier's size with `torch.from_file(...,
shared=True)`: writes go to the page cache and the kernel writes them back to the file as it
sees fit, so the tier's bytes live on disk, not in the process's anonymous memory. Nothing from
an earlier process is ever trusted: given a directory, the file is new (a unique name) and is
unlinked as soon as it is mapped, so no later process can open it; given a file path, the file
is truncated to zero and then sized, so every slot starts zeroed. The cache's bookkeeping
(kvserve.kvcache) starts empty either way, so no slot is readable before this process wrote it.
No flush is needed: the mapping is the only reader and the bytes need not survive the process.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.model.config import ModelConfig
from kvserve.model.paged_attention import KVCache


@dataclass(frozen=True, slots=True)
class DiskKV:
    """The disk tier's per-layer caches, each K and V [num_slots, block_size, kv_heads, hd],
    views of one file-backed tensor; `path` names the file (already unlinked when it was
    created in a directory)."""

    caches: list[KVCache]
    path: Path
    num_bytes: int


def allocate_disk_kv_caches(config: ModelConfig, num_slots: int, block_size: int, *,
                            dtype: torch.dtype, path: str | os.PathLike[str]) -> DiskKV:
    """Map `num_slots` zeroed slots onto a file under `path` (an existing directory: a new
    file in it; otherwise: that file, created or truncated). Raises ValueError, saying what to
    change, when `path` cannot hold the tier."""
    if num_slots < 1:
        raise ValueError(f"a disk tier needs at least one slot, got {num_slots}")
    shape = (config.num_hidden_layers, 2, num_slots, block_size, config.num_key_value_heads,
             config.head_dim)
    numel = 1
    for dim in shape:
        numel *= dim
    num_bytes = numel * torch.empty((), dtype=dtype).element_size()
    target = Path(path)
    in_directory = target.is_dir()
    try:
        if in_directory:
            fd, name = tempfile.mkstemp(prefix=f"kvserve-kv-{os.getpid()}-", suffix=".bin",
                                        dir=target)
            file = Path(name)
        else:
            fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            file = target
        try:
            os.ftruncate(fd, num_bytes)  # zero-filled: a stale byte can never be read
        finally:
            os.close(fd)
        flat = torch.from_file(str(file), shared=True, size=numel, dtype=dtype)  # [numel]
    except OSError as exc:
        raise ValueError(f"cannot create the disk KV tier ({num_bytes} bytes) at {target}: "
                         f"{exc.strerror or exc}; give a writable directory or file path with "
                         "room for it, or a smaller kv_disk_tier_bytes") from exc
    if in_directory:
        file.unlink()  # the mapping keeps the bytes; no other process can find them
    tiers = flat.view(shape)  # [layers, 2, num_slots, block_size, kv_heads, hd]
    caches = [KVCache(tiers[layer, 0], tiers[layer, 1]) for layer in range(shape[0])]
    return DiskKV(caches, file, num_bytes)
