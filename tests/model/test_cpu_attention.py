"""kvserve's CPU attention kernel against float64 softmax attention, and where it declines."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.model import cpu_attention, cpu_kernels

needs_attention = pytest.mark.skipif(
    not cpu_kernels.available("attention"),
    reason="kvserve's prefill attention kernel is not available here (needs x86-64 with "
           "AVX-512 and a C compiler)")
needs_paged_decode = pytest.mark.skipif(
    not cpu_kernels.available("paged_decode"),
    reason="kvserve's paged decode kernel is not available here (needs x86-64 with AVX-512 "
           "or AVX2 and a C compiler)")


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              causal_offset: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention: q [Lq, H, hd], k/v [Lk, KVH, hd] -> out [Lq, H, hd], lse [Lq, H]."""
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale  # [H, Lq, Lk]
    if causal_offset is not None:
        i = torch.arange(q.shape[0])[:, None]
        j = torch.arange(k.shape[0])[None, :]
        scores = scores.masked_fill(j > i + causal_offset, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)
    return out, torch.logsumexp(scores, -1).transpose(0, 1)


# (q_len, kv_len, heads, kv heads, causal offset): shapes around the kernel's 48-row and
# 128-key blocks, GQA groups of 1-6, a single decode row, chunks after cached context.
SHAPES = [
    (1, 1, 1, 1, 0), (1, 17, 2, 1, 16), (5, 300, 8, 8, None), (37, 100, 4, 2, 63),
    (47, 47, 6, 1, 0), (48, 48, 3, 3, 0), (49, 177, 6, 2, 128), (130, 130, 6, 2, 0),
    (64, 1030, 12, 4, None), (257, 257, 2, 1, 0), (16, 129, 4, 4, None),
]


# Every head dim on the small shapes; the large ones at three head dims, to keep the suite quick.
CASES = [(hd, *shape) for hd in cpu_attention.HEAD_DIMS for shape in SHAPES
         if hd in (16, 64, 128) or shape[0] * shape[1] <= 20_000]


@needs_attention
@pytest.mark.parametrize(("head_dim", "q_len", "kv_len", "heads", "kv_heads", "offset"), CASES)
def test_matches_float64_attention(head_dim, q_len, kv_len, heads, kv_heads, offset):
    gen = torch.Generator().manual_seed(q_len * 1000 + kv_len + head_dim)
    q = 3 * torch.randn(q_len, heads, head_dim, generator=gen)  # wide scores: a real softmax
    k = torch.randn(kv_len, kv_heads, head_dim, generator=gen)
    v = torch.randn(kv_len, kv_heads, head_dim, generator=gen)
    scale = 1 / math.sqrt(head_dim)
    got = cpu_attention.attention(q, k, v, scale, causal_offset=offset, with_lse=True)
    assert got is not None and got[1] is not None
    want_out, want_lse = reference(q, k, v, scale, offset)
    torch.testing.assert_close(got[0].double(), want_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got[1].double(), want_lse, atol=2e-5, rtol=1e-5)


@needs_attention
def test_reads_strided_inputs_in_place():
    """q/k/v as the views a fused qkv projection yields: token stride > heads * head_dim."""
    gen = torch.Generator().manual_seed(7)
    tokens, heads, kv_heads, hd = 70, 4, 2, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * hd, generator=gen)
    q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    q, k, v = (t.view(tokens, -1, hd) for t in (q, k, v))
    assert not q.is_contiguous() and not k.is_contiguous()
    got = cpu_attention.attention(q, k, v, 0.3, causal_offset=0)
    assert got is not None and got[1] is None
    torch.testing.assert_close(got[0].double(), reference(q, k, v, 0.3, 0)[0],
                               atol=2e-5, rtol=1e-5)


@needs_attention
def test_masked_keys_get_no_weight():
    """A huge value behind the causal mask must not leak into any output."""
    q = torch.randn(8, 2, 16)
    k = torch.randn(8, 1, 16)
    v = torch.zeros(8, 1, 16)
    v[-1] = 1e30  # visible only to the last query
    out = cpu_attention.attention(q, k, v, 0.25, causal_offset=0)
    assert out is not None
    assert torch.all(out[0][:-1] == 0)
    assert torch.all(out[0][-1] > 1e25)


@needs_attention
@pytest.mark.parametrize("case", ["float16", "head_dim_24", "last_dim_strided",
                                  "disabled", "dtype_mismatch"])
def test_declines_what_it_does_not_serve(case):
    q, k, v = torch.randn(4, 2, 32), torch.randn(4, 1, 32), torch.randn(4, 1, 32)
    if case == "float16":
        q, k, v = q.half(), k.half(), v.half()
    elif case == "head_dim_24":
        q, k, v = torch.randn(4, 2, 24), torch.randn(4, 1, 24), torch.randn(4, 1, 24)
    elif case == "last_dim_strided":
        q = torch.randn(4, 2, 64)[..., ::2]
    elif case == "dtype_mismatch":
        k = k.double()
    if case == "disabled":
        with cpu_kernels.disabled():
            assert cpu_attention.attention(q, k, v, 0.2) is None
        assert cpu_attention.attention(q, k, v, 0.2) is not None
    else:
        assert cpu_attention.attention(q, k, v, 0.2) is None


@needs_attention
def test_bfloat16_is_computed_in_float32_and_returned_in_the_querys_dtype():
    """bf16 q/k/v: exactly the float32 kernel on their widened values, the output rounded to
    bf16 (a float32 query gets float32 back over bf16 keys); the lse is float32 either way."""
    gen = torch.Generator().manual_seed(5)
    q = (3 * torch.randn(37, 6, 64, generator=gen)).bfloat16()
    k = torch.randn(100, 2, 64, generator=gen).bfloat16()
    v = torch.randn(100, 2, 64, generator=gen).bfloat16()
    wide = cpu_attention.attention(q.float(), k.float(), v.float(), 0.125, causal_offset=63,
                                   with_lse=True)
    got = cpu_attention.attention(q, k, v, 0.125, causal_offset=63, with_lse=True)
    mixed = cpu_attention.attention(q.float(), k, v, 0.125, causal_offset=63)
    assert wide is not None and got is not None and mixed is not None
    assert got[0].dtype == torch.bfloat16 and got[1] is not None and got[1].dtype == torch.float32
    torch.testing.assert_close(got[0], wide[0].bfloat16(), atol=0, rtol=0)
    torch.testing.assert_close(got[1], wide[1], atol=0, rtol=0)
    torch.testing.assert_close(mixed[0], wide[0], atol=0, rtol=0)
    # k and v as the fused qkv projection yields them: strided bf16 views, read in place.
    kv = torch.cat([k, v], dim=-1)  # [100, 2, 128]
    strided = cpu_attention.attention(q, kv[..., :64], kv[..., 64:], 0.125, causal_offset=63)
    assert strided is not None
    torch.testing.assert_close(strided[0], got[0], atol=0, rtol=0)


@needs_attention
def test_negative_causal_offset_is_refused():
    q, k = torch.randn(4, 2, 32), torch.randn(4, 1, 32)
    with pytest.raises(ValueError, match="causal_offset must be >= 0"):
        cpu_attention.attention(q, k, k, 0.2, causal_offset=-1)


def paged_case(gen: torch.Generator, head_dim: int, heads: int, kv_heads: int, bs: int,
               lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random caches [64, bs, KVH, hd] and block tables (blocks in random order) for decodes
    with context `lens`: (query [D, H, hd], key_cache, value_cache, tables [D, max_blocks])."""
    num_blocks = 64
    key_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=gen)
    width = max(-(-n // bs) for n in lens)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in lens])
    query = 3 * torch.randn(len(lens), heads, head_dim, generator=gen)
    return query, key_cache, value_cache, tables


def gather(cache: torch.Tensor, table: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return cache[table].flatten(0, 1)[start:end]  # [end - start, KVH, hd]


@needs_paged_decode
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4), (12, 1)])
@pytest.mark.parametrize("with_window", [False, True])
def test_paged_decode_reads_the_cache_in_place(head_dim, heads, kv_heads, with_window):
    gen = torch.Generator().manual_seed(head_dim + heads + with_window)
    bs, lens = 4, [1, 5, 64, 65, 130, 17]
    query, key_cache, value_cache, tables = paged_case(gen, head_dim, heads, kv_heads, bs, lens)
    ends = torch.tensor(lens)
    starts = (ends - 7).clamp(min=0) if with_window else None
    scale = head_dim ** -0.5
    got = cpu_attention.paged_decode(query, key_cache, value_cache, tables, ends, scale,
                                     starts=starts)
    assert got is not None
    for i, n in enumerate(lens):
        first = int(starts[i]) if starts is not None else 0
        k, v = gather(key_cache, tables[i], first, n), gather(value_cache, tables[i], first, n)
        want, _ = reference(query[i:i + 1], k, v, scale, None)
        torch.testing.assert_close(got[i:i + 1].double(), want, atol=2e-5, rtol=1e-5)


@needs_paged_decode
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize(("query_dtype", "cache_dtype"), [
    (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float16)])
def test_paged_decode_reads_a_16_bit_cache_in_place(head_dim, query_dtype, cache_dtype):
    """A bf16 or fp16 cache is read as its exact float32 values (float32 arithmetic), so the
    result is float64 attention over those values, rounded to the query's dtype at the end."""
    gen = torch.Generator().manual_seed(head_dim + 3)
    bs, lens = 16, [1, 5, 64, 65, 130, 17]
    query, key_cache, value_cache, tables = paged_case(gen, head_dim, 8, 2, bs, lens)
    query = query.to(query_dtype)
    key_cache, value_cache = key_cache.to(cache_dtype), value_cache.to(cache_dtype)
    ends = torch.tensor(lens)
    got = cpu_attention.paged_decode(query, key_cache, value_cache, tables, ends,
                                      head_dim ** -0.5)
    assert got is not None and got.dtype == query_dtype
    for i, n in enumerate(lens):
        k, v = gather(key_cache, tables[i], 0, n), gather(value_cache, tables[i], 0, n)
        want, _ = reference(query[i:i + 1], k, v, head_dim ** -0.5, None)
        if query_dtype == torch.bfloat16:
            want = want.bfloat16().double()  # one rounding of the float32 result
        torch.testing.assert_close(got[i:i + 1].double(), want, atol=2e-5 if query_dtype ==
                                   torch.float32 else 8e-3, rtol=1e-5)


@needs_paged_decode
@pytest.mark.parametrize("case", ["mixed_caches", "float64_cache"])
def test_paged_decode_declines_caches_it_does_not_read(case):
    gen = torch.Generator().manual_seed(1)
    query, key_cache, value_cache, tables = paged_case(gen, 32, 4, 2, 4, [3, 9])
    if case == "mixed_caches":
        value_cache = value_cache.bfloat16()
    else:
        key_cache, value_cache = key_cache.double(), value_cache.double()
    assert cpu_attention.paged_decode(query, key_cache, value_cache, tables,
                                      torch.tensor([3, 9]), 0.2) is None


@needs_paged_decode
def test_paged_decode_merges_the_prior_part_exactly():
    """The prior (a shared head's output and log-sum-exp) and the tail merge into attention
    over the head's keys followed by the tail's."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, hd, bs, lens = 6, 2, 32, 8, [1, 9, 40]
    query, key_cache, value_cache, tables = paged_case(gen, hd, heads, kv_heads, bs, lens)
    head_k = torch.randn(100, kv_heads, hd, generator=gen)
    head_v = torch.randn(100, kv_heads, hd, generator=gen)
    prior_out, prior_lse = reference(query, head_k, head_v, 0.2, None)
    got = cpu_attention.paged_decode(query, key_cache, value_cache, tables, torch.tensor(lens),
                                     0.2, prior=(prior_out.float(), prior_lse.float()))
    assert got is not None
    for i, n in enumerate(lens):
        k = torch.cat([head_k, gather(key_cache, tables[i], 0, n)])
        v = torch.cat([head_v, gather(value_cache, tables[i], 0, n)])
        want, _ = reference(query[i:i + 1], k, v, 0.2, None)
        torch.testing.assert_close(got[i:i + 1].double(), want, atol=2e-5, rtol=1e-5)


@needs_paged_decode
def test_paged_decode_declines_groups_beyond_its_limit():
    gen = torch.Generator().manual_seed(0)
    heads = 2 * cpu_attention.MAX_GROUP
    query, key_cache, value_cache, tables = paged_case(gen, 16, heads, 1, 4, [3])
    assert cpu_attention.paged_decode(query, key_cache, value_cache, tables,
                                      torch.tensor([3]), 0.25) is None


@needs_paged_decode
@pytest.mark.parametrize("case", ["whole", "window", "prior"])
def test_one_long_decode_split_by_keys_across_threads_equals_attention(case):
    """One decode with few kv heads (SmolLM2's 9/3) has fewer items than threads can share:
    the AVX2 set splits its keys in one range a thread and merges the parts by their
    log-sum-exps (the prior part riding with the first). Every case equals attention over all
    the keys, whichever set runs."""
    gen = torch.Generator().manual_seed(21)
    heads, kv_heads, hd, bs, n = 9, 3, 64, 16, 1000
    query, key_cache, value_cache, tables = paged_case(gen, hd, heads, kv_heads, bs, [n])
    first = 300 if case == "window" else 0
    k, v = gather(key_cache, tables[0], first, n), gather(value_cache, tables[0], first, n)
    prior = None
    if case == "prior":
        head_k = torch.randn(50, kv_heads, hd, generator=gen)
        head_v = torch.randn(50, kv_heads, hd, generator=gen)
        prior_out, prior_lse = reference(query, head_k, head_v, 0.125, None)
        prior = (prior_out.float(), prior_lse.float())
        k, v = torch.cat([head_k, k]), torch.cat([head_v, v])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = cpu_attention.paged_decode(
            query, key_cache, value_cache, tables, torch.tensor([n]), 0.125,
            starts=torch.tensor([first]) if case == "window" else None, prior=prior)
    finally:
        torch.set_num_threads(threads)
    assert got is not None
    want, _ = reference(query, k, v, 0.125, None)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)
