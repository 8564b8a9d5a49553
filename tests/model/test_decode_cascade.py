"""Decodes sharing a head of blocks: the plan, and both cascade paths equal attending to each
whole context. The cache is random everywhere, so a slot read that should not be shows, and
scores stay moderate, so head and tail both weigh in and a wrong merge shows too."""

from __future__ import annotations

import pytest
import torch

from kvserve.model import decode_cascade
from kvserve.model.attention_metadata import AttentionMetadata
from kvserve.model.decode_cascade import cascade_decode, cascade_decode_portable
from kvserve.model.paged_attention import KVCache, paged_attention

BS = 4
HEAD = [3, 9, 17, 22, 5]  # five shared blocks, scattered through the pool
# Per decode: its blocks after the head, and its context length (new token included). The
# shortest context ends 1 token past the 5-block head; one tail spans 3 blocks, two are padded.
TAILS = [([30, 31, 32], 31), ([33], 21), ([35, 36], 25), ([37, 38], 27)]


def junk_cache(num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int) -> KVCache:
    gen = torch.Generator().manual_seed(seed)
    shape = (48, BS, num_kv_heads, head_dim)
    return KVCache(torch.randn(shape, generator=gen).to(dtype),
                   torch.randn(shape, generator=gen).to(dtype))


def whole_context(query, cache, tables, seq_lens, scale):
    """Per decode, float64 softmax attention over its whole context. -> [D, H, hd] float64."""
    outs = []
    for q, table, seq_len in zip(query.double(), tables, seq_lens, strict=True):
        k = cache.key_cache[table].flatten(0, 1)[:seq_len].double()  # [L, KVH, hd]
        v = cache.value_cache[table].flatten(0, 1)[:seq_len].double()
        group = q.shape[0] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        probs = (torch.einsum("hd,lhd->hl", q, k) * scale).softmax(-1)
        outs.append(torch.einsum("hl,lhd->hd", probs, v))
    return torch.stack(outs)


def decode_step(tails=TAILS):
    tables = [HEAD + tail for tail, _ in tails]
    seq_lens = [n for _, n in tails]
    return AttentionMetadata.from_lists([1] * len(tails), seq_lens, tables, BS), tables, seq_lens


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("path", ["dispatch", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cascade_equals_whole_context_attention(num_heads, num_kv_heads, path, dtype,
                                               attention_impl):
    head_dim, scale = 16, 0.25
    cache = junk_cache(num_kv_heads, head_dim, dtype, seed=num_heads)
    meta, tables, seq_lens = decode_step()
    plan = meta.decode_cascade(BS)
    assert plan is not None and plan.head_len == 20 and plan.tail_len == 12
    query = torch.randn(len(TAILS), num_heads, head_dim,
                        generator=torch.Generator().manual_seed(1)).to(dtype)
    run = cascade_decode if path == "dispatch" else cascade_decode_portable
    got = run(query, cache, plan, scale)
    assert got.dtype == dtype and got.shape == query.shape
    want = whole_context(query, cache, tables, seq_lens, scale)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_cpu_float32_takes_the_flash_path(monkeypatch):
    def refuse(*args):
        raise AssertionError("the portable path was taken")

    monkeypatch.setattr(decode_cascade, "cascade_decode_portable", refuse)
    meta, _, _ = decode_step()
    query = torch.randn(len(TAILS), 8, 16)
    plan = meta.decode_cascade(BS)
    assert plan is not None
    cascade_decode(query, junk_cache(2, 16, torch.float32, 0), plan, 0.25)


@pytest.mark.parametrize("with_prefill", [False, True])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_paged_attention_decodes_through_the_cascade(with_prefill, cache_dtype, attention_impl):
    """A decode-only step (its output is the decodes' rows directly) and a step that also
    prefills a chunk on another prefix: both equal each context attended whole, over a float32
    cache and over a bf16 or fp16 one under float32 queries (`--kv-cache-dtype`)."""
    num_heads, num_kv_heads, head_dim = 6, 2, 8
    cache = junk_cache(num_kv_heads, head_dim, cache_dtype, seed=7)
    tails = TAILS + ([([40, 41], 7)] if with_prefill else [])
    tables = [HEAD + t for t, _ in TAILS] + ([[40, 41]] if with_prefill else [])
    seq_lens = [n for _, n in tails]
    query_lens = [1] * len(TAILS) + ([3] if with_prefill else [])
    meta = AttentionMetadata.from_lists(query_lens, seq_lens, tables, BS)
    assert meta.decode_cascade(BS) is not None
    gen = torch.Generator().manual_seed(2)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    out = paged_attention(query, key, value, cache, meta)  # writes the step's K/V first
    want = whole_context(query[:len(TAILS)], cache, tables[:len(TAILS)],
                         seq_lens[:len(TAILS)], head_dim ** -0.5)
    torch.testing.assert_close(out[:len(TAILS)].double(), want, atol=1e-5, rtol=1e-5)


def test_head_ends_before_every_decodes_new_token():
    # Both tables list blocks 1-5, but decode b's context ends at block 5's last slot (its new
    # token is there), so the head is the first four blocks.
    meta = AttentionMetadata.from_lists([1, 1], [23, 20], [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5]],
                                        BS)
    plan = meta.decode_cascade(BS)
    assert plan is not None
    assert plan.head_block_ids.tolist() == [1, 2, 3, 4] and plan.head_len == 16
    assert plan.tail_block_ids.tolist() == [5, 6, 5, 0]  # b's padding slot: block 0, masked
    assert plan.tail_lens.tolist() == [7, 4] and plan.tail_len == 8


@pytest.mark.parametrize(("tables", "seq_lens", "num_head"), [
    ([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 8, 9]], [27, 26], 5),  # diverge after five
    ([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8, 9]], [23, 23], None),  # three shared: too short
    ([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [11, 2, 3, 4, 5, 6]], [23] * 3, None),
    ([[1, 2, 3, 4, 5, 6]], [23], None),  # a lone decode
])
def test_head_is_the_blocks_every_decode_lists_first(tables, seq_lens, num_head):
    meta = AttentionMetadata.from_lists([1] * len(tables), seq_lens, tables, BS)
    plan = meta.decode_cascade(BS)
    assert (plan and plan.head_len // BS) == num_head


def test_host_rows_of_mixed_types_still_share_their_head():
    tables = [(1, 2, 3, 4, 5, 6), [1, 2, 3, 4, 5, 7]]  # a tuple row and a list row
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([23, 22], dtype=torch.int32),
        block_tables=torch.tensor([list(t) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor([5 * BS + 2, 6 * BS + 1]),
        block_tables_cpu=tables)
    plan = meta.decode_cascade(BS)
    assert plan is not None and plan.head_block_ids.tolist() == [1, 2, 3, 4, 5]


def test_tail_bias_shows_each_head_only_its_kv_heads_visible_keys():
    meta, _, _ = decode_step()
    plan = meta.decode_cascade(BS)
    assert plan is not None
    bias = plan.tail_bias(6, 2)  # group 3: heads 0-2 read kv head 0, heads 3-5 kv head 1
    assert bias.shape == (len(TAILS), 6, plan.tail_len * 2)
    seen = (bias == 0).view(len(TAILS), 6, plan.tail_len, 2)
    assert bool((bias[~(bias == 0)] == float("-inf")).all())
    for d, (_, seq_len) in enumerate(TAILS):
        for h in range(6):
            visible = [(pos, h // 3) for pos in range(seq_len - plan.head_len)]
            assert seen[d, h].nonzero().tolist() == [list(p) for p in visible]
    assert plan.tail_bias(6, 2) is bias  # built once per step
