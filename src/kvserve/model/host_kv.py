"""The host tier's KV tensors and the copies between the device KV cache and the tiers.

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
                     host_caches: Sequence[KVCache],
                     disk_caches: Sequence[KVCache] = ()) -> None:
    """Run one step's copies, batched per layer and kind: every demotion (host slot -> disk
    slot) first, since offloads overwrite host slots; then every offload (device block -> host
    slot), since loads and the forward pass may overwrite the blocks; then every load (host or
    disk slot -> device block). Returns once the host and disk tensors hold what was copied."""
    # Invariant: nothing overwrites a block or slot before every copy out of it has read it.
    if not transfers:
        return
    t = transfers
    copy_blocks(host_caches, disk_caches, [op.host_slot for op in t.demotions],
                [op.disk_slot for op in t.demotions])
    copy_blocks(device_caches, host_caches, [op.block_id for op in t.offloads],
                [op.host_slot for op in t.offloads])
    copy_blocks(host_caches, device_caches, [op.host_slot for op in t.loads],
                [op.block_id for op in t.loads])
    copy_blocks(disk_caches, device_caches, [op.disk_slot for op in t.disk_loads],
                [op.block_id for op in t.disk_loads])


def copy_blocks(src_caches: Sequence[KVCache], dst_caches: Sequence[KVCache],
                src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
    """Copy block `src_ids[i]` of every layer's K and V into block `dst_ids[i]`, across
    devices if need be (a copy to the CPU completes before this returns)."""
    if not src_ids:
        return
    assert len(src_caches) == len(dst_caches), "copies between tiers of different models"
    src_device = src_caches[0].key_cache.device
    dst_device = dst_caches[0].key_cache.device
    src = torch.tensor(src_ids, dtype=torch.long, device=src_device)  # [num_copies]
    dst = torch.tensor(dst_ids, dtype=torch.long, device=dst_device)  # [num_copies]
    for src_cache, dst_cache in zip(src_caches, dst_caches, strict=True):
        for s, d in ((src_cache.key_cache, dst_cache.key_cache),
                     (src_cache.value_cache, dst_cache.value_cache)):
            # [num_copies, block_size, kv_heads, hd]
            d.index_copy_(0, dst, s.index_select(0, src).to(dst_device))
