"""Paged attention: the contract on raw tensors, and chunked/mixed steps through a real model."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvserve.model import (
    AttentionMetadata,
    ModelConfig,
    allocate_kv_caches,
    compute_positions,
    kv_cache_bytes_per_block,
    load_model,
    paged_attention,
)
from kvserve.model.paged_attention import KVCache, write_kv_cache

from .paged_harness import PagedRunner


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int,
                    window: int | None) -> torch.Tensor:
    """Textbook causal attention. q [q_len, H, hd]; k, v [ctx, KVH, hd] -> [q_len, H, hd]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5  # [H, q_len, ctx]
    q_pos = torch.arange(first_pos, first_pos + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 3])
def test_mixed_step_matches_dense_attention(block_size: int, window: int | None,
                                            attention_impl: str) -> None:
    gen = torch.Generator().manual_seed(block_size)
    num_heads, num_kv_heads, head_dim, num_blocks = 6, 2, 16, 64
    # (cached tokens, new tokens): decode, fresh prefill, chunk after a cached prefix, decode.
    seqs = [(9, 1), (0, 7), (5, 6), (20, 1), (3, 1)]
    cache = KVCache(100 * torch.randn(num_blocks, block_size, num_kv_heads, head_dim,
                                      generator=gen),
                    100 * torch.randn(num_blocks, block_size, num_kv_heads, head_dim,
                                      generator=gen))  # finite junk everywhere
    free = list(range(num_blocks))
    random.Random(0).shuffle(free)
    tables, full_k, full_v, qs = [], [], [], []
    for cached, new in seqs:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // block_size))]
        tables.append(table)
        full_k.append(torch.randn(total, num_kv_heads, head_dim, generator=gen))
        full_v.append(torch.randn(total, num_kv_heads, head_dim, generator=gen))
        qs.append(torch.randn(new, num_heads, head_dim, generator=gen))
        if cached:  # earlier steps wrote the prefix
            prior = AttentionMetadata.from_lists([cached], [cached], [table], block_size)
            write_kv_cache(full_k[-1][:cached], full_v[-1][:cached], cache, prior.slot_mapping)
    metadata = AttentionMetadata.from_lists([n for _, n in seqs], [c + n for c, n in seqs],
                                            tables, block_size)
    out = paged_attention(
        torch.cat(qs), torch.cat([k[c:] for k, (c, _) in zip(full_k, seqs, strict=True)]),
        torch.cat([v[c:] for v, (c, _) in zip(full_v, seqs, strict=True)]), cache, metadata,
        sliding_window=window)
    expected = torch.cat([dense_attention(q, k, v, c, window)
                          for q, k, v, (c, _) in zip(qs, full_k, full_v, seqs, strict=True)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_float32_queries_over_a_16_bit_cache_attend_to_the_rounded_rows(
        cache_dtype: torch.dtype, attention_impl: str) -> None:
    """`--kv-cache-dtype bf16` or `fp16` under a float32 model: every path (a fresh prefill, a
    chunk after cached context, decodes) attends over K/V as the cache holds them, rounded, so
    a prefix-cache hit reads what a miss did; the result is float32."""
    gen = torch.Generator().manual_seed(11)
    block_size, num_heads, num_kv_heads, head_dim, num_blocks = 4, 6, 2, 16, 32
    seqs = [(0, 7), (5, 6), (9, 1), (20, 1)]  # (cached tokens, new tokens)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    cache = KVCache(torch.randn(shape, generator=gen).to(cache_dtype),
                    torch.randn(shape, generator=gen).to(cache_dtype))
    free = list(range(num_blocks))
    random.Random(1).shuffle(free)
    tables, full_k, full_v, qs = [], [], [], []
    for cached, new in seqs:
        total = cached + new
        tables.append([free.pop() for _ in range(-(-total // block_size))])
        full_k.append(torch.randn(total, num_kv_heads, head_dim, generator=gen))
        full_v.append(torch.randn(total, num_kv_heads, head_dim, generator=gen))
        qs.append(torch.randn(new, num_heads, head_dim, generator=gen))
        if cached:
            prior = AttentionMetadata.from_lists([cached], [cached], [tables[-1]], block_size)
            write_kv_cache(full_k[-1][:cached], full_v[-1][:cached], cache, prior.slot_mapping)
    metadata = AttentionMetadata.from_lists([n for _, n in seqs], [c + n for c, n in seqs],
                                            tables, block_size)
    out = paged_attention(
        torch.cat(qs), torch.cat([k[c:] for k, (c, _) in zip(full_k, seqs, strict=True)]),
        torch.cat([v[c:] for v, (c, _) in zip(full_v, seqs, strict=True)]), cache, metadata)
    assert out.dtype == torch.float32 and cache.key_cache.dtype == cache_dtype
    rounded = [(k.to(cache_dtype).float(), v.to(cache_dtype).float())
               for k, v in zip(full_k, full_v, strict=True)]
    expected = torch.cat([dense_attention(q, k, v, c, None)
                          for q, (k, v), (c, _) in zip(qs, rounded, seqs, strict=True)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_from_lists_derives_slots_positions_and_host_copies() -> None:
    metadata = AttentionMetadata.from_lists([3, 1], [5, 2], [[7, 2, 9], [4]], block_size=2)
    # seq 0: positions 2, 3, 4 -> blocks 2, 2, 9; seq 1: position 1 -> block 4, offset 1
    assert metadata.slot_mapping.tolist() == [4, 5, 18, 9]
    assert compute_positions([3, 1], [5, 2]).tolist() == [2, 3, 4, 1]
    assert metadata.query_start_loc.tolist() == [0, 3, 4]
    assert metadata.block_tables.tolist() == [[7, 2, 9], [4, 0, 0]]
    assert metadata.query_start_loc.dtype == torch.int32
    assert metadata.seq_lens.dtype == torch.int32
    assert metadata.block_tables.dtype == torch.int32
    assert metadata.slot_mapping.dtype == torch.int64
    assert metadata.prefill_seq_idx == (0,) and metadata.decode_seq_idx == (1,)
    assert metadata.num_seqs == 2 and metadata.num_tokens == 4
    rebuilt = AttentionMetadata(metadata.query_start_loc, metadata.seq_lens,
                                metadata.block_tables, metadata.slot_mapping)
    assert rebuilt.query_start_cpu == (0, 3, 4) and rebuilt.seq_lens_cpu == (5, 2)


@pytest.mark.parametrize(("query_lens", "seq_lens", "tables", "match"), [
    ([0], [3], [[0, 1]], "query_len"),
    ([4], [3], [[0, 1]], "query_len"),
    ([1], [5], [[0, 1]], "cannot hold"),
    ([1, 1], [1], [[0]], "one entry per sequence"),
])
def test_from_lists_rejects_malformed_steps(query_lens: list[int], seq_lens: list[int],
                                            tables: list[list[int]], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AttentionMetadata.from_lists(query_lens, seq_lens, tables, block_size=2)


def test_allocation_shapes_and_bytes(llama_dir: Path) -> None:
    config = ModelConfig.from_file(llama_dir)
    caches = allocate_kv_caches(config, num_blocks=5, block_size=4, dtype=torch.bfloat16,
                                device="cpu")
    assert len(caches) == config.num_hidden_layers
    assert caches[0].key_cache.shape == (5, 4, config.num_key_value_heads, config.head_dim)
    assert caches[0].num_blocks == 5 and caches[0].block_size == 4
    assert not caches[0].value_cache.any()
    per_block = sum(c.key_cache[0].nbytes + c.value_cache[0].nbytes for c in caches)
    assert kv_cache_bytes_per_block(config, 4, torch.bfloat16) == per_block


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_chunked_prefill_equals_one_shot(llama_dir: Path, block_size: int,
                                         attention_impl: str) -> None:
    model = load_model(llama_dir).model
    ids = torch.randint(4, 300, (37,), generator=torch.Generator().manual_seed(5)).tolist()
    one_shot = PagedRunner(model, block_size=block_size, seed=1).step([("s", ids)])["s"]
    runner = PagedRunner(model, block_size=block_size, seed=2)
    chunks = [ids[:13], ids[13:14], ids[14:]]  # unaligned to blocks; a 1-token chunk decodes
    chunked = torch.cat([runner.step([("s", chunk)])["s"] for chunk in chunks])
    torch.testing.assert_close(chunked, one_shot, atol=1e-4, rtol=1e-4)


def test_mixed_step_equals_each_sequence_alone(llama_dir: Path, attention_impl: str) -> None:
    model = load_model(llama_dir).model
    gen = torch.Generator().manual_seed(9)
    prompt = {s: torch.randint(4, 300, (n,), generator=gen).tolist()
              for s, n in (("a", 9), ("b", 21), ("c", 12))}
    alone = {}
    for seq in ("a", "b", "c"):
        runner = PagedRunner(model, seed=3)
        if seq == "c":
            alone[seq] = runner.step([("c", prompt["c"])])["c"]
        else:
            runner.step([(seq, prompt[seq][:-1])])
            alone[seq] = runner.step([(seq, prompt[seq][-1:])])[seq]
    runner = PagedRunner(model, seed=4)
    runner.step([("a", prompt["a"][:-1])])
    runner.step([("b", prompt["b"][:-1])])
    runner.step([("x", prompt["b"])])
    runner.free("x")  # c will reuse x's dirty blocks
    mixed = runner.step([("a", prompt["a"][-1:]), ("c", prompt["c"]), ("b", prompt["b"][-1:])])
    for seq in ("a", "b", "c"):
        torch.testing.assert_close(mixed[seq], alone[seq], atol=1e-5, rtol=1e-5)


def test_bfloat16_model_runs_the_same_path(llama_dir: Path) -> None:
    fp32 = load_model(llama_dir).model
    bf16 = load_model(llama_dir, dtype=torch.bfloat16).model
    assert next(bf16.parameters()).dtype == torch.bfloat16
    ids = list(range(4, 30))
    ref = PagedRunner(fp32).step([("s", ids[:-1])])
    low_runner = PagedRunner(bf16)
    low = low_runner.step([("s", ids[:-1])])
    assert low_runner.caches[0].key_cache.dtype == torch.bfloat16
    assert low["s"].dtype == torch.float32  # logits are always float32
    assert (low["s"] - ref["s"]).abs().mean() < 0.1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bfloat16_matches_cpu_float32(llama_dir: Path) -> None:
    cpu = load_model(llama_dir).model
    gpu = load_model(llama_dir, device="cuda", dtype=torch.bfloat16).model
    ids = list(range(4, 40))
    ref_runner, gpu_runner = PagedRunner(cpu), PagedRunner(gpu)
    ref = ref_runner.step([("a", ids), ("b", ids[:9])])
    out = gpu_runner.step([("a", ids), ("b", ids[:9])])
    ref2 = ref_runner.step([("a", [5]), ("b", [6])])
    out2 = gpu_runner.step([("a", [5]), ("b", [6])])
    for seq in ("a", "b"):
        assert (out[seq].cpu() - ref[seq]).abs().mean() < 0.1
        assert (out2[seq].cpu() - ref2[seq]).abs().mean() < 0.1
