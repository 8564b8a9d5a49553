"""`python -m benchmarks attention`: kvserve's CPU attention kernels against PyTorch's, per shape.

The shapes are the attention calls of `kvserve bench engine`'s shared-prefix workload (one
1,024-token prefix, 31 suffixes of 32 tokens, 32 decodes over the shared head), for the heads of
its two models: the first request's causal prefill over its own 1,056 tokens, the suffixes'
queries against the shared head (the prefill cascade), the decodes' queries against the head
(the decode cascade), and a decode-heavy step (32 decodes over 256-token contexts, paged).
The peer is what kvserve runs without its kernels: PyTorch's CPU flash-attention kernel (GQA
folded into rows, as kvserve's fallback calls it) and, for paged decode, the gather plus masked
SDPA of the reference path. Every kvserve result is checked against the peer's before timing.
Reports the median of `--repeats` timed calls after two warm-ups, GFLOP/s (useful work: masked
scores not counted), and the speedup.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

HEADS = {"tiny": (8, 4, 32), "100m": (12, 4, 64)}  # (heads, kv heads, head dim) per model


@dataclass(frozen=True, slots=True)
class AttentionRow:
    """One shape: kvserve's kernel and PyTorch's, median ms, GFLOP/s and the speedup."""

    model: str
    call: str
    kvserve_ms: float
    pytorch_ms: float
    gflops_kvserve: float
    gflops_pytorch: float
    speedup: float


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("attention", help="kvserve's CPU attention kernels vs PyTorch's, by shape")
    p.add_argument("--model", nargs="+", default=list(HEADS), choices=list(HEADS))
    p.add_argument("--repeats", type=int, default=20, help="timed calls per shape and system")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true", help="one JSON object per shape")
    p.set_defaults(func=run)


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def _cases(model: str) -> list[tuple[str, Callable[[], Any], Callable[[], Any], float]]:
    """(call, kvserve fn, pytorch fn, useful FLOPs) for one model's head shape."""
    import torch
    import torch.nn.functional as F

    from kvserve.model import cpu_attention

    heads, kv_heads, hd = HEADS[model]
    group, scale = heads // kv_heads, hd ** -0.5
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def cascade(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], Any]:
        return lambda: cpu_attention.attention(q, k, v, scale, with_lse=True)

    def folded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], Any]:
        rows = q.shape[0] * group
        q_rows = q.view(q.shape[0], kv_heads, group, hd).transpose(0, 1).reshape(
            1, kv_heads, rows, hd)
        kk, vv = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        return lambda: flash(q_rows, kk, vv, 0.0, False, attn_mask=None, scale=scale)

    cases: list[tuple[str, Callable[[], Any], Callable[[], Any], float]] = []
    q, k, v = rand(1056, heads, hd), rand(1056, kv_heads, hd), rand(1056, kv_heads, hd)
    cases.append(("prefill causal 1056", lambda: cpu_attention.attention(
        q, k, v, scale, causal_offset=0), lambda: F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        is_causal=True, scale=scale, enable_gqa=True), 1056 * 1057 / 2 * heads * hd * 4))
    for name, num_q in (("prefill cascade head 992x1024", 992),
                        ("decode cascade head 32x1024", 32)):
        qh, kh, vh = rand(num_q, heads, hd), rand(1024, kv_heads, hd), rand(1024, kv_heads, hd)
        cases.append((name, cascade(qh, kh, vh), folded(qh, kh, vh),
                      num_q * 1024 * heads * hd * 4))
    cases.append(_paged_decode_case(heads, kv_heads, hd, scale, rand))
    return cases


def _paged_decode_case(heads: int, kv_heads: int, hd: int, scale: float,
                       rand: Callable[..., Any]) -> tuple[str, Callable[[], Any],
                                                          Callable[[], Any], float]:
    import torch

    from kvserve.model import AttentionMetadata, cpu_attention, cpu_kernels
    from kvserve.model.paged_attention import KVCache, paged_attention, write_kv_cache

    decodes, ctx, bs = 32, 256, 16
    blocks = decodes * ctx // bs
    cache = KVCache(rand(blocks + 1, bs, kv_heads, hd), rand(blocks + 1, bs, kv_heads, hd))
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(1))
    tables = order.view(decodes, ctx // bs)
    seq_lens = torch.full((decodes,), ctx)
    q = rand(decodes, heads, hd)
    # The reference path of the same call: what kvserve runs with its kernels off.
    meta = AttentionMetadata.from_lists([1] * decodes, [ctx] * decodes, tables.tolist(), bs)
    k_new, v_new = rand(decodes, kv_heads, hd), rand(decodes, kv_heads, hd)
    write_kv_cache(k_new, v_new, cache, meta.slot_mapping)  # what every reference call rewrites

    def reference() -> Any:
        with cpu_kernels.disabled():
            return paged_attention(q, k_new, v_new, cache, meta)

    return ("paged decode 32x256", lambda: cpu_attention.paged_decode(
        q, cache.key_cache, cache.value_cache, tables, seq_lens, scale), reference,
        decodes * ctx * heads * hd * 4)


def _measure(models: list[str], repeats: int) -> list[AttentionRow]:
    import torch

    rows = []
    for model in models:
        for call, ours, theirs, flops in _cases(model):
            mine, peer = ours(), theirs()
            mine_out = mine[0] if isinstance(mine, tuple) else mine
            peer_out = peer[0] if isinstance(peer, tuple) else peer
            if peer_out.dim() == 4:  # folded flash rows [1, KVH, N*G, hd] -> [N, H, hd]
                kvh, hd = peer_out.shape[1], peer_out.shape[3]
                peer_out = peer_out[0].view(kvh, mine_out.shape[0], -1, hd).transpose(0, 1)
                peer_out = peer_out.reshape(mine_out.shape)
            elif peer_out.shape != mine_out.shape:  # SDPA's [1, H, L, hd]
                peer_out = peer_out[0].transpose(0, 1)
            torch.testing.assert_close(mine_out, peer_out, atol=1e-4, rtol=1e-4)
            ours_ms, theirs_ms = _median_ms(ours, repeats), _median_ms(theirs, repeats)
            rows.append(AttentionRow(model, call, ours_ms, theirs_ms, flops / ours_ms / 1e6,
                                     flops / theirs_ms / 1e6, theirs_ms / ours_ms))
    return rows


def run(args: argparse.Namespace) -> int:
    import torch

    from kvserve.model import cpu_kernels

    if args.repeats < 1 or args.threads < 1:
        raise SystemExit("--repeats and --threads must be at least 1")
    if not cpu_kernels.available("attention"):
        raise SystemExit("kvserve's CPU kernels are not available here (they need x86-64 with "
                         "AVX-512 and a C compiler: set $CC or install gcc)")
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        rows = _measure(args.model, args.repeats)
    finally:
        torch.set_num_threads(threads_before)
    if args.json:
        for row in rows:
            print(json.dumps(asdict(row)))
        return 0
    print("| model | call | kvserve ms | PyTorch ms | GFLOP/s kvserve / PyTorch | speedup |"
          "\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.model} | {r.call} | {r.kvserve_ms:.2f} | {r.pytorch_ms:.2f} | "
              f"{r.gflops_kvserve:.0f} / {r.gflops_pytorch:.0f} | {r.speedup:.2f}x |")
    return 0
