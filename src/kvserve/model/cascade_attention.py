"""Cascade attention: sequences that share a head of KV blocks read that head once.

A shared prompt prefix (a system prompt, a few-shot head, n samples of one prompt) sits in the
same physical blocks of many block tables. Attending to it separately per sequence gathers and
multiplies the same K/V again and again. Here the head is attended to once for every query of
every sequence that shares it, each sequence's own part (its tail) separately, and the two
softmax parts are merged exactly by their log-sum-exp:

    out = (o_head * exp(lse_head - lse) + o_tail * exp(lse_tail - lse)),
    lse = log(exp(lse_head) + exp(lse_tail))

which equals softmax attention over the whole context (up to float rounding). The head lies
wholly before every query that reads it, so its part needs no mask; the tail part carries the
causal mask. This module holds the prefill chunks' cascade and the two helpers; decodes take
decode_cascade. Every cascade path is an exact replacement for the reference path in
paged_attention and is only taken without a sliding window.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from kvserve.model import cpu_attention
from kvserve.model.attention_metadata import MIN_CASCADE_BLOCKS, PrefillCascade

if TYPE_CHECKING:  # paged_attention imports this module
    from kvserve.model.paged_attention import KVCache

__all__ = ["MIN_CASCADE_BLOCKS", "attend_with_lse", "cascade_prefill", "merge_by_lse"]


def attend_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                    *, is_causal: bool = False, mask: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention that also returns each row's log-sum-exp of the scaled scores.

    query [B, H, Lq, hd]; key, value [B, H, Lk, hd] (same head count); `mask` [Lq, Lk] bool
    (True: visible) or `is_causal` (top-left aligned, Lq == Lk). Returns out [B, H, Lq, hd]
    in query's dtype and lse [B, H, Lq] float32. Every row must see at least one key.
    """
    if query.device.type == "cpu" and query.dtype in (torch.float32, torch.bfloat16):
        key, value = key.to(query.dtype), value.to(query.dtype)  # a bf16 cache's, widened
        bias = None
        if mask is not None:
            bias = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
            bias.masked_fill_(~mask, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal,
            attn_mask=None if bias is None else bias[None, None], scale=scale)
        return out, lse.float()
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale  # [B,H,Lq,Lk]
    if is_causal:
        lq, lk = scores.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, Lq]
    probs = (scores - lse[..., None]).exp()
    return torch.matmul(probs, value.float()).to(query.dtype), lse


def merge_by_lse(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                 lse_b: torch.Tensor) -> torch.Tensor:
    """Combine two softmax parts over disjoint key sets. out_* [N, H, hd], lse_* [N, H] ->
    [N, H, hd] in out_a's dtype: attention over the union of the keys."""
    lse = torch.logaddexp(lse_a, lse_b)  # [N, H]
    w_a, w_b = (lse_a - lse).exp()[..., None], (lse_b - lse).exp()[..., None]
    return (out_a.float() * w_a + out_b.float() * w_b).to(out_a.dtype)


def cascade_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: KVCache, plan: PrefillCascade, scale: float) -> torch.Tensor:
    """Prefill chunks sharing a head: query/key/value are the step's flattened rows
    [T, H | KVH, hd]; returns the rows `plan.rows` [N, H, hd] (in that order)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.key_cache.shape[2]
    group = num_heads // num_kv_heads
    q = query.index_select(0, plan.rows)  # [N, H, hd]
    num_rows = q.shape[0]
    # Head: every query of every member against K/V gathered once. GQA folds each kv head's
    # query heads into rows, so K/V are never repeated: [1, KVH, N*G, hd] x [1, KVH, Lh, hd].
    k_head = kv_cache.key_cache.index_select(0, plan.head_block_ids).flatten(0, 1)  # [Lh,KVH,hd]
    v_head = kv_cache.value_cache.index_select(0, plan.head_block_ids).flatten(0, 1)
    fast = cpu_attention.attention(q, k_head, v_head, scale, with_lse=True)
    if fast is not None and fast[1] is not None:
        o_tail, lse_tail = _tails(q, key, value, kv_cache, plan, scale)
        return merge_by_lse(fast[0], fast[1], o_tail, lse_tail)
    q_rows = q.view(num_rows, num_kv_heads, group, head_dim).transpose(0, 1).reshape(
        1, num_kv_heads, num_rows * group, head_dim)
    o_head, lse_head = attend_with_lse(q_rows, k_head.transpose(0, 1)[None],
                                       v_head.transpose(0, 1)[None], scale)
    o_head = o_head[0].view(num_kv_heads, num_rows, group, head_dim).transpose(0, 1).reshape(
        num_rows, num_heads, head_dim)  # [N, H, hd]
    lse_head = lse_head[0].view(num_kv_heads, num_rows, group).transpose(0, 1).reshape(
        num_rows, num_heads)  # [N, H]
    o_tail, lse_tail = _tails(q, key, value, kv_cache, plan, scale)
    return merge_by_lse(o_head, lse_head, o_tail, lse_tail)


def _tails(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache,
           plan: PrefillCascade, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each member's queries over its context after the head (causal). q [N, H, hd] in plan
    row order -> out [N, H, hd], lse [N, H]."""
    num_heads = q.shape[1]
    group = num_heads // key.shape[1]
    head_len = plan.head_len
    by_kernel = _tails_by_kernel(q, key, value, kv_cache, plan, scale)
    if by_kernel is not None:
        return by_kernel
    fresh_only = all(ctx == head_len for ctx in plan.context_starts)
    if fresh_only and len(set(plan.query_lens)) == 1:
        # The common case (equal suffixes right after a shared prompt): one batched call.
        q_len = plan.query_lens[0]
        num = len(plan.query_lens)
        k = key.index_select(0, plan.rows).view(num, q_len, *key.shape[1:])  # [M, q, KVH, hd]
        v = value.index_select(0, plan.rows).view(num, q_len, *value.shape[1:])
        k = k.repeat_interleave(group, dim=2).transpose(1, 2)  # [M, H, q, hd]
        v = v.repeat_interleave(group, dim=2).transpose(1, 2)
        qq = q.view(num, q_len, num_heads, -1).transpose(1, 2)  # [M, H, q, hd]
        out, lse = attend_with_lse(qq, k, v, scale, is_causal=True)
        return out.transpose(1, 2).reshape(q.shape), lse.transpose(1, 2).reshape(q.shape[:2])
    outs, lses = [], []
    for qq, k, v, first in _member_tails(q, key, value, kv_cache, plan):
        tail_len = k.shape[0]
        k_pos = torch.arange(tail_len, device=q.device)[None, :]
        q_pos = torch.arange(first, tail_len, device=q.device)[:, None]
        out, lse = attend_with_lse(
            qq.transpose(0, 1)[None], k.repeat_interleave(group, dim=1).transpose(0, 1)[None],
            v.repeat_interleave(group, dim=1).transpose(0, 1)[None], scale,
            mask=k_pos <= q_pos)  # [1, H, q, hd], [1, H, q]
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0].transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def _member_tails(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache,
                  plan: PrefillCascade,
                  ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
    """Each member in plan row order: its queries [q, H, hd], its context after the head k, v
    [tail, KVH, hd] (this step's fresh K/V, or read from the cache when cached context lies
    between the head and the chunk), and its first query's position in that tail."""
    head_len, row = plan.head_len, 0
    for start, q_len, ctx, seq_len, table in zip(
            plan.query_starts, plan.query_lens, plan.context_starts, plan.seq_lens,
            plan.tail_block_ids, strict=True):
        if ctx == head_len:
            k, v = key[start:start + q_len], value[start:start + q_len]  # [q, KVH, hd]
        else:
            k = kv_cache.key_cache.index_select(0, table).flatten(0, 1)[:seq_len - head_len]
            v = kv_cache.value_cache.index_select(0, table).flatten(0, 1)[:seq_len - head_len]
        yield q[row:row + q_len], k, v, ctx - head_len
        row += q_len


def _tails_by_kernel(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache,
                     plan: PrefillCascade, scale: float,
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`_tails` through the CPU kernel, one call per member (its tail is a causal chunk whose
    first query sits `first` tokens into the tail); None where the kernel does not serve these
    tensors (it then serves none of the members: they share dtype and shapes)."""
    out = torch.empty(q.shape, dtype=q.dtype)  # [N, H, hd]
    lse = torch.empty(q.shape[:2])  # [N, H]
    row = 0
    for qq, k, v, first in _member_tails(q, key, value, kv_cache, plan):
        fast = cpu_attention.attention(qq, k, v, scale, causal_offset=first, with_lse=True)
        if fast is None or fast[1] is None:
            return None
        out[row:row + len(qq)], lse[row:row + len(qq)] = fast
        row += len(qq)
    return out, lse
