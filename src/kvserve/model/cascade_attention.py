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
causal mask. Both paths here are exact replacements for the reference path in paged_attention
and are only taken without a sliding window.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvserve.model.attention_metadata import MIN_CASCADE_BLOCKS, DecodeBatch, PrefillCascade

if TYPE_CHECKING:  # paged_attention imports this module
    from kvserve.model.paged_attention import KVCache

__all__ = ["MIN_CASCADE_BLOCKS", "attend_with_lse", "cascade_decode", "cascade_prefill",
           "merge_by_lse", "shared_head_blocks"]


def attend_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                    *, is_causal: bool = False, mask: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention that also returns each row's log-sum-exp of the scaled scores.

    query [B, H, Lq, hd]; key, value [B, H, Lk, hd] (same head count); `mask` [Lq, Lk] bool
    (True: visible) or `is_causal` (top-left aligned, Lq == Lk). Returns out [B, H, Lq, hd]
    in query's dtype and lse [B, H, Lq] float32. Every row must see at least one key.
    """
    if query.device.type == "cpu" and query.dtype in (torch.float32, torch.bfloat16):
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
    outs, lses, row = [], [], 0
    for start, q_len, ctx, seq_len, table in zip(
            plan.query_starts, plan.query_lens, plan.context_starts, plan.seq_lens,
            plan.tail_block_ids, strict=True):
        qq = q[row:row + q_len]  # [q, H, hd]
        row += q_len
        if ctx == head_len:
            k, v = key[start:start + q_len], value[start:start + q_len]  # [q, KVH, hd]
        else:  # cached context between the head and this chunk: read it from the cache
            k = kv_cache.key_cache.index_select(0, table).flatten(0, 1)[:seq_len - head_len]
            v = kv_cache.value_cache.index_select(0, table).flatten(0, 1)[:seq_len - head_len]
        tail_len = k.shape[0]
        k_pos = torch.arange(tail_len, device=q.device)[None, :]
        q_pos = torch.arange(ctx - head_len, seq_len - head_len, device=q.device)[:, None]
        out, lse = attend_with_lse(
            qq.transpose(0, 1)[None], k.repeat_interleave(group, dim=1).transpose(0, 1)[None],
            v.repeat_interleave(group, dim=1).transpose(0, 1)[None], scale,
            mask=k_pos <= q_pos)  # [1, H, q, hd], [1, H, q]
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0].transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def shared_head_blocks(tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> int:
    """Leading blocks every decode's table lists identically (a shared prompt prefix), capped so
    they lie wholly inside every context."""
    if tables.shape[0] < 2:
        return 0
    same = (tables == tables[:1]).all(dim=0)  # [num_blocks]
    shared = int(same.logical_not().nonzero()[0]) if not bool(same.all()) else same.numel()
    return min(shared, int(seq_lens.min()) // block_size)


def cascade_decode(query: torch.Tensor, kv_cache: KVCache, plan: DecodeBatch, scale: float,
                   num_shared: int, num_blocks: int) -> torch.Tensor:
    """Decodes that share a head of blocks: attend to the head once for all queries, to each
    tail separately, and merge the two softmax parts exactly (log-sum-exp). query [D, H, hd]
    -> [D, H, hd]. Reads the shared K/V once instead of once per sequence."""
    block_size = kv_cache.block_size
    num_decodes, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.key_cache.shape[2]
    group = num_heads // num_kv_heads
    q = query.float().view(num_decodes, num_kv_heads, group, head_dim)  # [D, KVH, G, hd]
    # Head: one [KVH, D*G, L_head] score matrix against K/V gathered once.
    head_ids = plan.block_tables[0, :num_shared]
    k_head = kv_cache.key_cache.index_select(0, head_ids).flatten(0, 1).float()  # [Lh, KVH, hd]
    v_head = kv_cache.value_cache.index_select(0, head_ids).flatten(0, 1).float()
    q_rows = q.permute(1, 0, 2, 3).reshape(num_kv_heads, num_decodes * group, head_dim)
    s_head = torch.bmm(q_rows, k_head.permute(1, 2, 0)) * scale  # [KVH, D*G, Lh]
    m_head = s_head.amax(dim=-1, keepdim=True)  # [KVH, D*G, 1]
    p_head = (s_head - m_head).exp()
    l_head = p_head.sum(dim=-1, keepdim=True)  # [KVH, D*G, 1]
    o_head = torch.bmm(p_head, v_head.permute(1, 0, 2))  # [KVH, D*G, hd]
    # Tails: each decode's own blocks after the head, masked to its length.
    tail = plan.block_tables[:, num_shared:num_blocks].reshape(-1)  # [D * nt]
    tail_len = (num_blocks - num_shared) * block_size
    k_tail = kv_cache.key_cache.index_select(0, tail).view(
        num_decodes, tail_len, num_kv_heads, head_dim).float()  # [D, Lt, KVH, hd]
    v_tail = kv_cache.value_cache.index_select(0, tail).view(
        num_decodes, tail_len, num_kv_heads, head_dim).float()
    s_tail = torch.einsum("dkgh,dlkh->dkgl", q, k_tail) * scale  # [D, KVH, G, Lt]
    pos = num_shared * block_size + torch.arange(tail_len, device=query.device)
    visible = pos[None, :] < plan.seq_lens[:, None]  # [D, Lt]
    s_tail = s_tail.masked_fill(~visible[:, None, None, :], float("-inf"))
    m_tail = s_tail.amax(dim=-1, keepdim=True)  # [D, KVH, G, 1]; -inf for an empty tail
    m_tail = torch.where(torch.isinf(m_tail), torch.zeros_like(m_tail), m_tail)
    p_tail = (s_tail - m_tail).exp()
    l_tail = p_tail.sum(dim=-1, keepdim=True)
    o_tail = torch.einsum("dkgl,dlkh->dkgh", p_tail, v_tail)  # [D, KVH, G, hd]
    # Merge: bring the head's parts to [D, KVH, G, *] and combine with a common max.
    def per_decode(x: torch.Tensor) -> torch.Tensor:
        return x.view(num_kv_heads, num_decodes, group, -1).permute(1, 0, 2, 3)
    m_h, l_h, o_h = per_decode(m_head), per_decode(l_head), per_decode(o_head)
    m = torch.maximum(m_h, m_tail)
    w_head, w_tail = (m_h - m).exp(), (m_tail - m).exp()
    out = (o_h * w_head + o_tail * w_tail) / (l_h * w_head + l_tail * w_tail)
    return out.reshape(num_decodes, num_heads, head_dim).to(query.dtype)
