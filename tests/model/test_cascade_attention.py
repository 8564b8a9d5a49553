"""Prefill chunks sharing a head of blocks: the cascade path equals attending to each context
whole (decodes: test_decode_cascade)."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.attention_metadata import AttentionMetadata
from kvserve.model.cascade_attention import attend_with_lse
from kvserve.model.paged_attention import KVCache, paged_attention, write_kv_cache


def dense_causal(q, k, v, first_pos, scale):
    """Textbook causal attention of q [q, H, hd] at positions first_pos.. over k, v [L, KVH, hd]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,lhd->hql", q, k) * scale
    q_pos = torch.arange(first_pos, first_pos + len(q))[:, None]
    visible = torch.arange(k.shape[0])[None, :] <= q_pos
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hql,lhd->qhd", scores.softmax(-1), v)


# (cached context, new tokens, shares the head): three chunks after the 5-block head (one of
# them with 3 more cached tokens of its own), a fresh prefill, a chunk over another prefix, a
# decode that shares the head.
MIXED = [(20, 6, True), (20, 3, True), (0, 9, False), (23, 4, True), (18, 5, False), (26, 1, True)]
EQUAL = [(20, 4, True), (20, 4, True), (20, 4, True)]


@pytest.mark.parametrize("seqs", [MIXED, EQUAL], ids=["mixed", "equal_suffixes"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "cache_dtype"),
                         [(8, 2, torch.float32), (4, 4, torch.float32), (8, 2, torch.bfloat16),
                          (8, 2, torch.float16)])
def test_prefill_cascade_equals_whole_context_attention(seqs, num_heads, num_kv_heads,
                                                       cache_dtype, attention_impl):
    """Over a float32 cache, and over a bf16 or fp16 one under float32 queries
    (`--kv-cache-dtype`), where every chunk attends over its K/V rounded as the cache holds
    them."""
    gen = torch.Generator().manual_seed(3)
    bs, hd, scale = 4, 16, 16 ** -0.5
    cache = KVCache((100 * torch.randn(64, bs, num_kv_heads, hd, generator=gen)).to(cache_dtype),
                    (100 * torch.randn(64, bs, num_kv_heads, hd, generator=gen)).to(cache_dtype))
    head = [3, 9, 17, 22, 5]
    head_k = torch.randn(20, num_kv_heads, hd, generator=gen)
    head_v = torch.randn(20, num_kv_heads, hd, generator=gen)
    free = iter(range(30, 64))
    tables, full_k, full_v, qs = [], [], [], []
    for cached, new, shares in seqs:
        total = cached + new
        k = torch.randn(total, num_kv_heads, hd, generator=gen)
        v = torch.randn(total, num_kv_heads, hd, generator=gen)
        table = list(head) if shares else []
        if shares:
            k[:20], v[:20] = head_k, head_v
        table += [next(free) for _ in range(-(-total // bs) - len(table))]
        tables.append(table)
        full_k.append(k)
        full_v.append(v)
        qs.append(torch.randn(new, num_heads, hd, generator=gen))
        if cached:  # earlier steps wrote the cached context
            prior = AttentionMetadata.from_lists([cached], [cached], [table], bs)
            write_kv_cache(k[:cached], v[:cached], cache, prior.slot_mapping)
    meta = AttentionMetadata.from_lists([n for _, n, _ in seqs], [c + n for c, n, _ in seqs],
                                        tables, bs)
    (plan,) = meta.prefill_cascades(bs)  # the cascade is really taken, for exactly these
    assert plan.seq_idx == tuple(i for i, (c, n, s) in enumerate(seqs) if s and n > 1)
    assert plan.head_len == 20
    out = paged_attention(torch.cat(qs),
                          torch.cat([k[c:] for k, (c, _, _) in zip(full_k, seqs, strict=True)]),
                          torch.cat([v[c:] for v, (c, _, _) in zip(full_v, seqs, strict=True)]),
                          cache, meta)
    held = [(k.to(cache_dtype).float(), v.to(cache_dtype).float())
            for k, v in zip(full_k, full_v, strict=True)]
    want = torch.cat([dense_causal(q, k, v, c, scale)
                      for q, (k, v), (c, _, _) in zip(qs, held, seqs, strict=True)])
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_prefill_chunks_share_only_a_common_cached_head():
    bs = 4
    # a and b share 5 blocks; c shares 4 of them but has cached only 4 blocks (17 tokens);
    # d starts with another block.
    tables = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 8, 9], [1, 2, 3, 4, 10], [11, 2, 3, 4, 5, 12]]
    meta = AttentionMetadata.from_lists([3, 3, 2, 3], [27, 26, 19, 23], tables, bs)
    (plan,) = meta.prefill_cascades(bs)
    assert plan.seq_idx == (0, 1, 2) and plan.head_len == 16
    assert plan.head_block_ids.tolist() == [1, 2, 3, 4]
    assert plan.rows.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    lone = AttentionMetadata.from_lists([3, 3], [27, 23], [tables[0], tables[3]], bs)
    assert lone.prefill_cascades(bs) == ()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # the CPU kernel; the fallback
def test_attention_with_lse_returns_the_log_sum_exp(dtype):
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, n, 8, generator=gen, dtype=dtype) for n in (5, 7, 7))
    scores = q @ k.transpose(-1, -2) * 0.3
    mask = torch.ones(5, 7, dtype=torch.bool).tril(2)
    for kwargs, allowed in (({}, None), ({"mask": mask}, mask),
                            ({"is_causal": True}, torch.ones(5, 7, dtype=torch.bool).tril())):
        s = scores if allowed is None else scores.masked_fill(~allowed, float("-inf"))
        out, lse = attend_with_lse(q, k, v, 0.3, **kwargs)
        torch.testing.assert_close(lse, s.logsumexp(-1).float(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out, s.softmax(-1) @ v, atol=1e-5, rtol=1e-5)
