"""The host tier's KV tensors and the copies between them and the device KV cache.

Host slots have the device blocks' layout exactly (one ``KVCache`` per layer, in host memory,
pinned when the device is CUDA so copies can use DMA), so a copy moves whole blocks along dim 0.
The cache's bookkeeping (kvserve.kvcache.host_tier) decides which slot holds which block; this
module only moves the bytes it is told to.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.kvcache import KVTransfers
from kvserve.model.config import ModelConfig
from kvserve.model.paged_attention import KVCache, allocate_kv_caches


def allocate_host_kv_caches(config: ModelConfig, num_slots: int, block_size: int, *,
                            dtype: torch.dtype, pin_memory: bool) -> list[KVCache]:
    """One zeroed host ``KVCache`` per layer, K and V [num_slots, block_size, kv_heads, hd]."""
    if num_slots < 1:
        raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
    return allocate_kv_caches(config, num_slots, block_size, dtype=dtype, device="cpu",
                              pin_memory=pin_memory)


def run_kv_transfers(transfers: KVTransfers, device_caches: Sequence[KVCache],
                     host_caches: Sequence[KVCache]) -> None:
    """Run one step's copies, batched per layer: every offload (device block -> host slot)
    first, since they read blocks that loads and the forward pass may overwrite, then every
    load (host slot -> device block). Returns once the host tensors hold what was offloaded."""
    # Invariant: no load or forward write touches a device block before its offload read it.
    if not transfers:
        return
    device = device_caches[0].key_cache.device
    if transfers.offloads:
        blocks = torch.tensor([op.block_id for op in transfers.offloads], dtype=torch.long,
                              device=device)  # [num_offloads]
        slots = torch.tensor([op.host_slot for op in transfers.offloads], dtype=torch.long)
        for dev, host in zip(device_caches, host_caches, strict=True):
            for src, dst in ((dev.key_cache, host.key_cache), (dev.value_cache, host.value_cache)):
                # [num_offloads, block_size, kv_heads, hd]; a synchronous device->host copy
                dst.index_copy_(0, slots, src.index_select(0, blocks).to(dst.device))
    if transfers.loads:
        slots = torch.tensor([op.host_slot for op in transfers.loads], dtype=torch.long)
        blocks = torch.tensor([op.block_id for op in transfers.loads], dtype=torch.long,
                              device=device)  # [num_loads]
        for dev, host in zip(device_caches, host_caches, strict=True):
            for src, dst in ((host.key_cache, dev.key_cache), (host.value_cache, dev.value_cache)):
                # [num_loads, block_size, kv_heads, hd]; stream-ordered before the forward pass
                dst.index_copy_(0, blocks, src.index_select(0, slots).to(device))
