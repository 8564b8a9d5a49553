"""Paged KV cache tensors and the reference (plain torch) paged attention.

Contract of one attention call, for a step that flattens the new tokens of many sequences:

- The new tokens of sequence i occupy ``query_start_loc[i]:query_start_loc[i+1]`` of the flattened
  batch. Its context is ``seq_lens[i]`` tokens INCLUDING them, so query token j sits at absolute
  position ``seq_lens[i] - query_len + j`` and attends to context positions ``<=`` its own (and,
  with a sliding window W, ``> own - W``).
- Every new token's K/V is first written to ``slot_mapping[t]`` (= block_id * block_size +
  offset; every entry a real slot, no -1 padding). Earlier context is read through
  ``block_tables[i]``, whose first ``ceil(seq_lens[i] / block_size)`` entries must name the
  blocks that hold positions 0.. in order. Later entries are padding (any block id, or -1) and
  are never read unmasked.
- Prefill chunks (query_len > 1, with or without cached context: chunked prefill, prefix-cache
  hit) and decodes (query_len == 1) mix freely in one step, in any order.

The reference path batches all decodes into one masked SDPA over a padded gather of their
contexts, and runs one SDPA per prefill chunk (a chunk with no cached context attends over its
fresh K/V, the very values just written, and skips the gather). It is device and dtype agnostic
(CPU float32, CUDA bf16) and needs no extension. Cost: the gathers copy each decode's whole
context once per layer, so this path is memory-bound; it is the correctness reference that
faster kernels must match. Where sequences share a head of blocks (a prefix-cache hit), decodes
and prefill chunks take the cascade paths of decode_cascade and cascade_attention instead (no
sliding window): the head is read once for all of them, with the same result. Prefill attention
without a sliding window, and every decode, run through kvserve's CPU kernels (cpu_attention)
where they serve the call: float32 or bfloat16 (computed in float32) on CPUs with AVX-512 (decodes
with AVX2 too), the same result in another summation order, decodes reading K/V in place from the
cache (no gather).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.model import cpu_attention
from kvserve.model.attention_metadata import AttentionMetadata, DecodeBatch, DecodeCascade
from kvserve.model.cascade_attention import cascade_prefill
from kvserve.model.config import ModelConfig
from kvserve.model.decode_cascade import cascade_decode


@dataclass(slots=True)
class KVCache:
    """One layer's paged keys and values; slot s is ``[s // block_size, s % block_size]``.

    Allocated zeroed, so never-written slots hold finite values and masking them out is exact.
    """

    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]

    @property
    def num_blocks(self) -> int:
        return self.key_cache.shape[0]

    @property
    def block_size(self) -> int:
        return self.key_cache.shape[1]


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block costs across all layers (K and V): what sizes the block pool."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * block_size * config.num_key_value_heads * config.head_dim * elem
    return per_layer * config.num_hidden_layers


def allocate_kv_caches(config: ModelConfig, num_blocks: int, block_size: int, *,
                       dtype: torch.dtype, device: torch.device | str,
                       pin_memory: bool = False) -> list[KVCache]:
    """One zeroed ``KVCache`` per layer, each K and V [num_blocks, block_size, kv_heads, hd]
    (`pin_memory`: page-locked host memory, for copies to and from a CUDA device)."""
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    return [
        KVCache(torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory),
                torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory))
        for _ in range(config.num_hidden_layers)
    ]


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache,
                   slot_mapping: torch.Tensor) -> None:
    """Store key/value [num_tokens, kv_heads, hd] at slot_mapping [num_tokens] (all slots >= 0)."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    flat_k = kv_cache.key_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, kv_heads, hd]
    flat_v = kv_cache.value_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, kv_heads, hd]
    flat_k.index_copy_(0, slot_mapping, key.to(flat_k.dtype))
    flat_v.index_copy_(0, slot_mapping, value.to(flat_v.dtype))


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: KVCache, attn_metadata: AttentionMetadata, *,
                    sliding_window: int | None = None) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend each query over its sequence's context.

    query [num_tokens, num_heads, hd]; key/value [num_tokens, kv_heads, hd]
    -> [num_tokens, num_heads, hd] in query's dtype. See the module docstring for the contract.
    """
    # Every path below attends over K/V as the cache holds them, this step's fresh rows too (a
    # bf16 cache under a float32 model rounds them), so a prefix-cache hit reads what a miss did.
    key, value = key.to(kv_cache.key_cache.dtype), value.to(kv_cache.value_cache.dtype)
    # Invariant: after the write, slots of positions < seq_lens[i] hold sequence i's K/V, so every
    # read below sees the full context, this step's tokens included.
    write_kv_cache(key, value, kv_cache, attn_metadata.slot_mapping)
    scale = 1.0 / math.sqrt(query.shape[-1])
    plan = attn_metadata.decode_batch()
    if plan is not None:
        shared = (attn_metadata.decode_cascade(kv_cache.block_size)
                  if sliding_window is None else None)
        if not attn_metadata.prefill_seq_idx:  # decodes only: row i is sequence i's token
            return _decode_attention(query, kv_cache, plan, shared, scale, sliding_window)
    out = torch.empty_like(query)  # [num_tokens, num_heads, hd]
    if plan is not None:
        out[plan.token_idx] = _decode_attention(query[plan.token_idx], kv_cache, plan,
                                                shared, scale, sliding_window)
    in_cascade: set[int] = set()
    if sliding_window is None:
        for cascade in attn_metadata.prefill_cascades(kv_cache.block_size):
            out.index_copy_(0, cascade.rows,
                            cascade_prefill(query, key, value, kv_cache, cascade, scale))
            in_cascade.update(cascade.seq_idx)
    for seq_idx in attn_metadata.prefill_seq_idx:
        if seq_idx in in_cascade:
            continue
        start = attn_metadata.query_start_cpu[seq_idx]
        end = attn_metadata.query_start_cpu[seq_idx + 1]
        seq_len = attn_metadata.seq_lens_cpu[seq_idx]
        out[start:end] = _prefill_attention(
            query[start:end], key[start:end], value[start:end], kv_cache,
            attn_metadata.block_tables[seq_idx], seq_len, scale, sliding_window)
    return out


def _prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       kv_cache: KVCache, block_table: torch.Tensor, seq_len: int,
                       scale: float, sliding_window: int | None) -> torch.Tensor:
    """One sequence's chunk: query [q_len, H, hd] over its seq_len context -> [q_len, H, hd]."""
    q_len = query.shape[0]
    context_start = seq_len - q_len
    if context_start == 0:
        # Whole context is this chunk: use the fresh K/V and skip the gather.
        keys, values = key, value  # [seq_len, kv_heads, hd]
    else:
        keys = _gather_context(kv_cache.key_cache, block_table, seq_len)  # [seq_len, kv_heads, hd]
        values = _gather_context(kv_cache.value_cache, block_table, seq_len)
    if sliding_window is None:
        fast = cpu_attention.attention(query, keys, values, scale, causal_offset=context_start)
        if fast is not None:
            return fast[0]
    keys, values = keys.to(query.dtype), values.to(query.dtype)  # a bf16 cache's, widened
    mask = None
    if context_start > 0 or sliding_window is not None:
        q_pos = torch.arange(context_start, seq_len, device=query.device)[:, None]  # [q_len, 1]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]  # [1, seq_len]
        mask = k_pos <= q_pos  # [q_len, seq_len]
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None],  # [1, H, q_len, hd]
        keys.transpose(0, 1)[None],  # [1, kv_heads, seq_len, hd]
        values.transpose(0, 1)[None],  # [1, kv_heads, seq_len, hd]
        attn_mask=mask, is_causal=mask is None, scale=scale,
        enable_gqa=query.shape[1] != keys.shape[1],
    )  # [1, H, q_len, hd]
    return out[0].transpose(0, 1)


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """cache [num_blocks, bs, kv_heads, hd], block_table [max_blocks] -> [seq_len, kv_heads, hd]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache.index_select(0, block_table[:num_blocks])  # [num_blocks, bs, kv_heads, hd]
    return blocks.flatten(0, 1)[:seq_len]


def _decode_attention(query: torch.Tensor, kv_cache: KVCache, plan: DecodeBatch,
                      cascade: DecodeCascade | None, scale: float,
                      sliding_window: int | None) -> torch.Tensor:
    """All decodes at once: query [D, H, hd] over padded contexts -> [D, H, hd]; through
    `cascade` when they share a head (never with a sliding window)."""
    if cascade is not None:
        return cascade_decode(query, kv_cache, cascade, scale)
    starts = None
    if sliding_window is not None:
        starts = (plan.seq_lens - sliding_window).clamp_(min=0)  # first key in the window
    fast = cpu_attention.paged_decode(query, kv_cache.key_cache, kv_cache.value_cache,
                                      plan.block_tables, plan.seq_lens, scale, starts=starts)
    if fast is not None:
        return fast
    block_size = kv_cache.block_size
    num_blocks = -(-plan.max_seq_len // block_size)
    tables = plan.block_tables[:, :num_blocks]  # [D, num_blocks]
    num_decodes = tables.shape[0]
    flat = tables.reshape(-1)  # [D * num_blocks]; index_select copies faster than fancy indexing
    keys = kv_cache.key_cache.index_select(0, flat).view(
        num_decodes, num_blocks * block_size, *kv_cache.key_cache.shape[2:])
    values = kv_cache.value_cache.index_select(0, flat).view(
        num_decodes, num_blocks * block_size, *kv_cache.value_cache.shape[2:])
    keys = keys[:, : plan.max_seq_len].transpose(1, 2)  # [D, kv_heads, max_seq_len, hd]
    values = values[:, : plan.max_seq_len].transpose(1, 2)  # [D, kv_heads, max_seq_len, hd]
    mask = plan.mask(sliding_window)[:, None, None, :]  # [D, 1, 1, max_seq_len]
    # On CPUs ATen's masked SDPA in bf16/fp16 is a scalar path: run it in float32 there.
    compute = torch.float32 if query.device.type == "cpu" else query.dtype
    out = F.scaled_dot_product_attention(
        query[:, :, None, :].to(compute),  # [D, H, 1, hd]
        keys.to(compute), values.to(compute), attn_mask=mask, scale=scale,
        enable_gqa=query.shape[1] != keys.shape[1],
    )  # [D, H, 1, hd]
    return out[:, :, 0, :].to(query.dtype)
