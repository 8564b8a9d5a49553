"""`python -m benchmarks one-stream`: the kernels a decode step at one sequence runs, at the rates
memory allows them. At one stream every weight and every layer's K/V is read once a step, from
DRAM, so each kernel is measured on DRAM-sized operands and its rate set against this machine's
read bandwidth, measured in the same run (`kvserve.bench.machine`).

- The one-token block matmul: one token through a Q4_1 and a Q8_0 matrix of 30 x 3,072 rows by
  576 (SmolLM2-135M's fused gate/up in every layer: 33 MB and 56 MB of blocks), through
  BlockKernelLinear's kernel call (no Python between rows). Reported as GB/s of block bytes
  and as a share of the read rate. The same kernel through 7 layers' rows (7.7 MB and 13 MB,
  called again and again, so the blocks sit in the last-level cache) gives its compute rate:
  where that is not above the read rate, the kernel's arithmetic, not memory, bounds a step's
  matmuls.
- Paged decode attention: one decode over 30 layers' caches (9 query heads, 3 KV heads, head dim
  64, blocks of 16 positions in a shuffled order, each layer's caches their own 4 MB tensors, as
  the engine lays them out), at several context lengths; 64 MB are written through the caches
  before each pass, so every pass reads K/V from DRAM as a step does.

Median (and best) of `--repeats` timed passes after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

ROWS, K = 30 * 3072, 576  # SmolLM2-135M's gate/up rows in 30 layers, its hidden size
CACHED_ROWS = 7 * 3072  # 7 layers' gate/up: 7.7 MB of Q4_1, 13 MB of Q8_0, inside a 32 MB L3
LAYERS, BLOCK, HEADS, KV_HEADS, HEAD_DIM = 30, 16, 9, 3, 64
CACHE_BLOCKS = 340  # 340 x 16 x 3 x 64 float32: ~4 MB a cache, a layer's share of 256 MB
EVICT_BYTES = 64 << 20


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("one-stream", help="one-token block matmuls and paged decode attention "
                       "on DRAM-sized operands, against the machine's read bandwidth")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=30, help="timed passes per measurement")
    p.add_argument("--keys", type=int, nargs="+", default=[150, 400, 1000],
                   help="context lengths for the attention passes")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=run)


def _timed(fn: Callable[[], Any], repeats: int,
           before: Callable[[], Any] | None = None) -> tuple[float, float]:
    """(median, best) seconds of fn over `repeats` passes, `before` run untimed ahead of each."""
    fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def block_matmuls(repeats: int) -> dict[str, dict[str, float]]:
    """ms and GB/s of one token through each block type's DRAM-sized matrix, and GB/s through
    a matrix held in cache (`cache_gb_s`, the median of `repeats` calls after a warm-up)."""
    import torch

    from kvserve.model.ggml_blocks import quantize
    from kvserve.model.quant_linear import BlockKernelLinear

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, K, generator=gen)
    out = {}
    for ggml_type, block_bytes in (("Q4_1", 20), ("Q8_0", 34)):
        layer = BlockKernelLinear(quantize(torch.randn(ROWS, K, generator=gen) * 0.05,
                                           ggml_type), None)
        nbytes = ROWS * K // 32 * block_bytes
        median, best = _timed(partial(layer, x), repeats)
        cached = BlockKernelLinear(quantize(torch.randn(CACHED_ROWS, K, generator=gen) * 0.05,
                                            ggml_type), None)
        cached_median, _ = _timed(partial(cached, x), repeats * 4)
        out[ggml_type] = {"mb": nbytes / 1e6, "ms": median * 1e3, "best_ms": best * 1e3,
                          "gb_s": nbytes / median / 1e9,
                          "cache_mb": CACHED_ROWS * K // 32 * block_bytes / 1e6,
                          "cache_gb_s": CACHED_ROWS * K // 32 * block_bytes / cached_median / 1e9}
    return out


def paged_decode(keys: list[int], repeats: int) -> dict[str, dict[str, float]]:
    """ms per 30 layers of one decode's paged attention, K/V cold, at each context length."""
    import torch

    from kvserve.model.cpu_attention import paged_decode as kernel

    gen = torch.Generator().manual_seed(1)
    shape = (CACHE_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
              for _ in range(LAYERS)]
    q = torch.randn(1, HEADS, HEAD_DIM, generator=gen)
    table = torch.randperm(CACHE_BLOCKS, generator=gen)[None].to(torch.int64)
    evict = torch.empty(EVICT_BYTES, dtype=torch.uint8)
    out = {}
    for n in keys:
        if n > CACHE_BLOCKS * BLOCK:
            raise SystemExit(f"--keys {n}: at most {CACHE_BLOCKS * BLOCK} fit the caches")
        ends = torch.tensor([n], dtype=torch.int64)

        def step(ends: torch.Tensor = ends) -> None:
            for k, v in caches:
                if kernel(q, k, v, table, ends, HEAD_DIM ** -0.5) is None:
                    raise SystemExit("kvserve's paged decode kernel does not serve this CPU")

        median, best = _timed(step, repeats, before=lambda: evict.fill_(1))
        kv_mb = 2 * LAYERS * n * KV_HEADS * HEAD_DIM * 4 / 1e6
        out[str(n)] = {"ms": median * 1e3, "best_ms": best * 1e3, "kv_mb": kv_mb,
                       "gb_s": kv_mb / 1e3 / median}
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    from kvserve.bench.machine import measure
    from kvserve.model import cpu_kernels

    if args.threads < 1 or args.repeats < 1 or min(args.keys) < 1:
        raise SystemExit("--threads, --repeats and --keys must be at least 1")
    if not cpu_kernels.available("quant") or not cpu_kernels.available("paged_decode"):
        raise SystemExit("kvserve's CPU kernels do not run here (they need x86-64 with AVX2 or "
                         "AVX-512 and a C compiler): nothing to measure")
    torch.set_num_threads(args.threads)
    read = measure(args.threads, gemm_shapes=((1, 256, 256),)).read_gb_s
    result = {"kernel_set": cpu_kernels.kernel_set(), "threads": args.threads,
              "read_gb_s": read, "block_matmul": block_matmuls(args.repeats),
              "paged_decode": paged_decode(args.keys, args.repeats)}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['kernel_set']} kernels, {args.threads} threads, read {read:.1f} GB/s")
    for name, r in result["block_matmul"].items():
        print(f"  one token, {name} {r['mb']:.1f} MB: {r['ms']:.2f} ms (best {r['best_ms']:.2f})"
              f" = {r['gb_s']:.1f} GB/s, {r['gb_s'] / read:.0%} of the read rate; "
              f"{r['cache_mb']:.1f} MB in cache: {r['cache_gb_s']:.1f} GB/s")
    for n, r in result["paged_decode"].items():
        print(f"  paged decode, 30 layers, {n} keys ({r['kv_mb']:.1f} MB of K/V, cold): "
              f"{r['ms']:.2f} ms (best {r['best_ms']:.2f}) = {r['gb_s']:.1f} GB/s")
    return 0
