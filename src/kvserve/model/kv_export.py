"""Block KV as bytes, for moving it between workers: read device blocks out, write host slots in.

A block's payload is its K and V for every layer, layer by layer (K then V), each
[block_size, num_kv_heads, head_dim] in the cache's dtype, C order: `block_payload_bytes` bytes.
Two workers can exchange blocks exactly when their `kv_layout` strings are equal.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.model.paged_attention import KVCache


def kv_layout(kv_caches: Sequence[KVCache]) -> str:
    """The layout a payload must have here, as one comparable string."""
    k = kv_caches[0].key_cache
    _, block_size, num_kv_heads, head_dim = k.shape
    dtype = str(k.dtype).removeprefix("torch.")
    return (f"{dtype};layers={len(kv_caches)};block_size={block_size};"
            f"kv_heads={num_kv_heads};head_dim={head_dim}")


def block_payload_bytes(kv_caches: Sequence[KVCache]) -> int:
    """Bytes of one block's payload (K and V of every layer)."""
    k = kv_caches[0].key_cache
    return 2 * len(kv_caches) * k[0].numel() * k.element_size()


def read_blocks(kv_caches: Sequence[KVCache], block_ids: Sequence[int]) -> list[bytes]:
    """A copy of each block's payload (host bytes: nothing refers to the cache afterwards)."""
    if not block_ids:
        return []
    device = kv_caches[0].key_cache.device
    ids = torch.tensor(list(block_ids), dtype=torch.long, device=device)  # [n]
    parts = [t.index_select(0, ids) for kv in kv_caches for t in (kv.key_cache, kv.value_cache)]
    stacked = torch.stack(parts, dim=1).cpu()  # [n, 2 * layers, block_size, kv_heads, hd]
    raw = stacked.contiguous().view(torch.uint8).reshape(len(block_ids), -1)  # [n, payload]
    return [bytes(row.numpy().data) for row in raw]


def write_host_slots(host_caches: Sequence[KVCache], slot_ids: Sequence[int],
                     payloads: Sequence[bytes]) -> None:
    """Write payloads (as `read_blocks` makes them) into host slots. Raises ValueError, writing
    nothing, when a payload has the wrong size."""
    if not slot_ids:
        return
    want = block_payload_bytes(host_caches)
    bad = [len(p) for p in payloads if len(p) != want]
    if bad or len(slot_ids) != len(payloads):
        raise ValueError(f"a block payload here is {want} bytes; got {bad or len(payloads)}")
    k = host_caches[0].key_cache
    shape = (len(payloads), 2 * len(host_caches), *k.shape[1:])
    raw = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
    blocks = raw.view(k.dtype).reshape(shape)  # [n, 2 * layers, block_size, kv_heads, hd]
    slots = torch.tensor(list(slot_ids), dtype=torch.long)  # [n]
    for layer, kv in enumerate(host_caches):
        kv.key_cache.index_copy_(0, slots, blocks[:, 2 * layer].to(kv.key_cache.device))
        kv.value_cache.index_copy_(0, slots, blocks[:, 2 * layer + 1].to(kv.key_cache.device))
