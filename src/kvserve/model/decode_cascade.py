"""Cascade attention for decodes: a step's decodes that share a head of KV blocks read it once.

After a shared prompt (a system prompt, a few-shot head, n samples of one prompt) every decode's
block table starts with the same blocks. The head is attended to once by all the decodes'
queries together, each decode's own blocks after it (its tail) separately, and the two softmax
parts are merged exactly (see cascade_attention for the log-sum-exp identity). The planner
(AttentionMetadata.decode_cascade) ends the head before every decode's new token, so no tail is
empty and no row's softmax is over nothing.

Three implementations of one contract, each an exact replacement for the reference decode path:

- CPU float32 or bfloat16 where kvserve's CPU kernels serve the call (cpu_attention, which
  computes in float32): the head through the
  attention kernel, the tails read in place from the cache by the paged decode kernel, which
  merges the head's part in.
- Other CPU float32 calls: the head through PyTorch's CPU flash-attention kernel, GQA folded
  into rows ([1, KVH, D*G, hd] against [1, KVH, L_head, hd], no K/V repeated); each tail with
  one batched matmul over all its kv heads' keys at once, other heads' keys masked, so the
  gathered tail is
  used in the cache's own layout, never transposed or copied again; the head enters the tail's
  softmax as one extra key whose score is its log-sum-exp and whose value is its output, so one
  softmax both normalises the tail and merges the parts. The tail matmuls do num_kv_heads times
  the necessary work, which is cheap while tails are short.
- Any device and dtype (the portable path): explicit float32 bmm/softmax for both parts and a
  merge through their running maxima.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvserve.model import cpu_attention
from kvserve.model.attention_metadata import DecodeCascade

if TYPE_CHECKING:  # paged_attention imports this module
    from kvserve.model.paged_attention import KVCache

__all__ = ["cascade_decode", "cascade_decode_portable"]


def cascade_decode(query: torch.Tensor, kv_cache: KVCache, plan: DecodeCascade,
                   scale: float) -> torch.Tensor:
    """Decodes sharing `plan`'s head: query [D, H, hd] (row i: decode i of the plan) ->
    [D, H, hd] in query's dtype, equal to attending over each whole context. Reads the head's
    K/V once for all D decodes; CPU float32 and bf16 take kvserve's kernels (else, float32, the
    flash-kernel path), the rest the portable one (see the module docstring)."""
    cache_dtype = kv_cache.key_cache.dtype
    if query.device.type == "cpu" and query.dtype in (torch.float32, torch.bfloat16) \
            and cache_dtype in cpu_attention.KV_CODES:  # a cache the kernels read
        # The head's K/V gathered once, for whichever CPU path serves the call.
        k_head = kv_cache.key_cache.index_select(0, plan.head_block_ids).flatten(0, 1)
        v_head = kv_cache.value_cache.index_select(0, plan.head_block_ids).flatten(0, 1)
        by_kernel = _cascade_decode_kernel(query, k_head, v_head, kv_cache, plan, scale)
        if by_kernel is not None:
            return by_kernel
        if query.dtype == torch.float32 == cache_dtype:
            return _cascade_decode_cpu(query, k_head, v_head, kv_cache, plan, scale)
    return cascade_decode_portable(query, kv_cache, plan, scale)


def _cascade_decode_kernel(query: torch.Tensor, k_head: torch.Tensor, v_head: torch.Tensor,
                           kv_cache: KVCache, plan: DecodeCascade,
                           scale: float) -> torch.Tensor | None:
    """kvserve's CPU kernels, or None where they do not serve the call: the head k/v
    [Lh, KVH, hd] through `cpu_attention.attention` (every decode's query against it), then
    each tail read in place from the cache by `cpu_attention.paged_decode`, which starts each
    row's softmax from the head's part (output and log-sum-exp): one exact merge, no copies."""
    # The head's part stays float32 (a bf16 query is widened first): it is merged, not output.
    head = cpu_attention.attention(query.float(), k_head, v_head, scale, with_lse=True)
    if head is None or head[1] is None:
        return None
    tables = plan.tail_block_ids.view(query.shape[0], -1)  # [D, tail_len // block_size]
    return cpu_attention.paged_decode(query, kv_cache.key_cache, kv_cache.value_cache, tables,
                                      plan.tail_lens, scale, prior=(head[0], head[1]))


def _cascade_decode_cpu(query: torch.Tensor, k_head: torch.Tensor, v_head: torch.Tensor,
                        kv_cache: KVCache, plan: DecodeCascade, scale: float) -> torch.Tensor:
    # Invariant: every row of the final softmax has a finite entry (the head's log-sum-exp),
    # and masked keys get probability exactly 0, so the result is exact up to rounding.
    num_decodes, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.key_cache.shape[2]
    group = num_heads // num_kv_heads
    q_rows = query.reshape(num_decodes, num_kv_heads, group, head_dim).transpose(0, 1).reshape(
        1, num_kv_heads, num_decodes * group, head_dim)  # [1, KVH, D*G, hd]
    o_head, lse_head = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q_rows, k_head.transpose(0, 1)[None], v_head.transpose(0, 1)[None], 0.0, False,
        scale=scale)  # [1, KVH, D*G, hd], [1, KVH, D*G]
    num_keys = plan.tail_len * num_kv_heads  # each decode's tail keys of every kv head
    k_tail = kv_cache.key_cache.index_select(0, plan.tail_block_ids).view(
        num_decodes, num_keys, head_dim)  # [D, tail_len * KVH, hd], position-major
    v_tail = kv_cache.value_cache.index_select(0, plan.tail_block_ids).view(
        num_decodes, num_keys, head_dim)
    scores = torch.baddbmm(plan.tail_bias(num_heads, num_kv_heads), query,
                           k_tail.transpose(1, 2), alpha=scale)  # [D, H, tail_len * KVH]
    lse_rows = lse_head.view(num_kv_heads, num_decodes, group).transpose(0, 1).reshape(
        num_decodes, num_heads, 1)  # [D, H, 1]
    probs = torch.cat([scores, lse_rows], dim=-1).softmax(dim=-1)  # [D, H, tail keys + 1]
    o_head = o_head.view(num_kv_heads, num_decodes, group, head_dim).transpose(0, 1)
    head_part = probs[..., num_keys:].view(num_decodes, num_kv_heads, group, 1) * o_head
    return torch.baddbmm(head_part.view(num_decodes, num_heads, head_dim),
                         probs[..., :num_keys], v_tail)  # [D, H, hd]


def cascade_decode_portable(query: torch.Tensor, kv_cache: KVCache, plan: DecodeCascade,
                            scale: float) -> torch.Tensor:
    """`cascade_decode` in plain float32 bmm/einsum/softmax (any device, any dtype): query
    [D, H, hd] -> [D, H, hd] in query's dtype."""
    num_decodes, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.key_cache.shape[2]
    group = num_heads // num_kv_heads
    q = query.float().reshape(num_decodes, num_kv_heads, group, head_dim)  # [D, KVH, G, hd]
    # Head: one [KVH, D*G, L_head] score matrix against K/V gathered once.
    k_head = kv_cache.key_cache.index_select(0, plan.head_block_ids).flatten(0, 1).float()
    v_head = kv_cache.value_cache.index_select(0, plan.head_block_ids).flatten(0, 1).float()
    q_rows = q.permute(1, 0, 2, 3).reshape(num_kv_heads, num_decodes * group, head_dim)
    s_head = torch.bmm(q_rows, k_head.permute(1, 2, 0)) * scale  # [KVH, D*G, Lh]
    m_head = s_head.amax(dim=-1, keepdim=True)  # [KVH, D*G, 1]
    p_head = (s_head - m_head).exp()
    l_head = p_head.sum(dim=-1, keepdim=True)  # [KVH, D*G, 1]
    o_head = torch.bmm(p_head, v_head.permute(1, 0, 2))  # [KVH, D*G, hd]
    # Tails: each decode's own blocks after the head, masked to its length (never empty).
    tail_shape = (num_decodes, plan.tail_len, num_kv_heads, head_dim)
    k_tail = kv_cache.key_cache.index_select(0, plan.tail_block_ids).view(tail_shape).float()
    v_tail = kv_cache.value_cache.index_select(0, plan.tail_block_ids).view(tail_shape).float()
    s_tail = torch.einsum("dkgh,dlkh->dkgl", q, k_tail) * scale  # [D, KVH, G, Lt]
    pos = torch.arange(plan.tail_len, device=query.device)
    visible = pos[None, :] < plan.tail_lens[:, None]  # [D, Lt]
    s_tail = s_tail.masked_fill(~visible[:, None, None, :], float("-inf"))
    m_tail = s_tail.amax(dim=-1, keepdim=True)  # [D, KVH, G, 1]
    p_tail = (s_tail - m_tail).exp()
    l_tail = p_tail.sum(dim=-1, keepdim=True)
    o_tail = torch.einsum("dkgl,dlkh->dkgh", p_tail, v_tail)  # [D, KVH, G, hd]

    def per_decode(x: torch.Tensor) -> torch.Tensor:  # [KVH, D*G, n] -> [D, KVH, G, n]
        return x.view(num_kv_heads, num_decodes, group, -1).permute(1, 0, 2, 3)

    m_h, l_h, o_h = per_decode(m_head), per_decode(l_head), per_decode(o_head)
    m = torch.maximum(m_h, m_tail)
    w_head, w_tail = (m_h - m).exp(), (m_tail - m).exp()
    out = (o_h * w_head + o_tail * w_tail) / (l_h * w_head + l_tail * w_tail)
    return out.reshape(num_decodes, num_heads, head_dim).to(query.dtype)
