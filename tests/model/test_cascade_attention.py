"""Decodes sharing a head of blocks: the cascade path equals attending to each context whole."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.attention_metadata import DecodeBatch
from kvserve.model.paged_attention import KVCache, _cascade_decode, _shared_head_blocks


def reference(query, kv_cache, tables, seq_lens, scale):
    outs = []
    for i, seq_len in enumerate(seq_lens.tolist()):
        k = kv_cache.key_cache[tables[i]].flatten(0, 1)[:seq_len]  # [L, KVH, hd]
        v = kv_cache.value_cache[tables[i]].flatten(0, 1)[:seq_len]
        rep = query.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("hd,lhd->hl", query[i], k) * scale
        outs.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v))
    return torch.stack(outs)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 2), (4, 4)])
def test_cascade_equals_whole_context_attention(num_heads, num_kv_heads):
    gen = torch.Generator().manual_seed(0)
    bs, hd = 4, 16
    cache = KVCache(torch.randn(40, bs, num_kv_heads, hd, generator=gen),
                    torch.randn(40, bs, num_kv_heads, hd, generator=gen))
    head = [3, 9, 17, 22, 5]
    tails = [[30, 31], [33, 0], [35, 0]]
    tables = torch.tensor([head + t for t in tails])
    seq_lens = torch.tensor([27, 21, 20])  # the last decode's context ends exactly at the head
    plan = DecodeBatch(token_idx=torch.arange(3), block_tables=tables, seq_lens=seq_lens,
                       max_seq_len=27)
    assert _shared_head_blocks(tables, seq_lens, bs) == 5
    query = torch.randn(3, num_heads, hd, generator=gen)
    got = _cascade_decode(query, cache, plan, hd ** -0.5, 5, tables.shape[1])
    want = reference(query, cache, tables, seq_lens, hd ** -0.5)
    assert torch.allclose(got, want, atol=1e-5)


def test_shared_head_is_capped_by_the_shortest_context():
    tables = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 5]])
    assert _shared_head_blocks(tables, torch.tensor([16, 9]), 4) == 2
    assert _shared_head_blocks(tables[:1], torch.tensor([16]), 4) == 0
