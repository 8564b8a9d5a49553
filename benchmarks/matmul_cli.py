"""`python -m benchmarks matmul`: kvserve's matmuls on a real model's projection shapes: the int8
x int8 one (`--quantization w8a8`) against its bf16 one and oneDNN's int8 GEMM, and the GGUF
block kernel (Q4_1, int16 activations) against decoding the weight to float32 for the call.

Shapes (M, N, K): SmolLM2-135M's four projections (fused q/k/v 960 x 576, o 576 x 576, fused
gate/up 3072 x 576, down 576 x 1536) at 64 rows (a decode step of 64 streams) and 2,048 rows
(a prefill chunk). Each system gets the same random weights: kvserve's int8 kernel
(Int8Linear: per-channel weights, activations quantized per block of 32 inside the call, float32
in and out), kvserve's bf16 kernel where it serves (Bf16Linear, else oneDNN's packed bf16), and
`torch._int_mm` (oneDNN's s8 x s8 -> s32 GEMM on ready int8 operands, no scales: the int8 rate
this machine allows, as `kvserve bench machine` reports it); then the weight as Q4_1 blocks
through kvserve's block kernel (BlockKernelLinear: csrc/quant_gemm.c from 16 rows where built,
else quant_matmul.c) and through the path prefill took before it (the blocks decoded to float32
by the kernel, then `F.linear`). Median of `--repeats` timed calls after a warm-up; GOP/s
counts 2 M N K.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2-135M's (N, K)
ROWS = (16, 64, 2048)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("matmul", help="kvserve's int8 x int8 matmul vs its bf16 one and "
                       "oneDNN's int8 GEMM, on SmolLM2's projection shapes")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per shape and system")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS),
                   help="M: rows a call multiplies")
    p.add_argument("--json", action="store_true", help="one JSON object per shape")
    p.set_defaults(func=run)


def _median_s(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(args: argparse.Namespace) -> int:
    import torch

    from kvserve.model import cpu_kernels
    from kvserve.model.int8_linear import int8_kernel_serves

    if args.repeats < 1 or args.threads < 1 or min(args.rows) < 1:
        raise SystemExit("--repeats, --threads and --rows must be at least 1")
    torch.set_num_threads(args.threads)
    if not int8_kernel_serves() or not cpu_kernels.available("quant"):
        print("kvserve's int8 kernel does not serve this CPU (it needs AVX512-VNNI): "
              "w8a8 runs the portable PyTorch path here, which this bench does not time")
        return 1
    gen = torch.Generator().manual_seed(0)
    for m in args.rows:
        for n, k in SHAPES:
            row = shape_row(m, n, k, args.repeats, gen)
            if args.json:
                print(json.dumps(row))
            else:
                print(f"M={m:5d} N={n:5d} K={k:5d}: kvserve int8 {row['kvserve_int8_gops']:6.1f}"
                      f", bf16 {row['kvserve_bf16_gops']:6.1f}, oneDNN int8 "
                      f"{row['onednn_int8_gops']:6.1f} GOP/s (int8/bf16 "
                      f"{row['int8_over_bf16']:.2f}x, of oneDNN's {row['int8_of_onednn']:.2f}); "
                      f"Q4_1 blocks {row['q4_1_blocks_gops']:6.1f}, decoded to float32 "
                      f"{row['q4_1_float32_gops']:6.1f} ({row['blocks_over_float32']:.2f}x)")
    return 0


def shape_row(m: int, n: int, k: int, repeats: int, gen: Any) -> dict[str, Any]:
    """GOP/s of each system at (m, n, k), and kvserve int8's ratios to the others."""
    import torch
    import torch.nn.functional as F

    from kvserve.model import cpu_kernels
    from kvserve.model.bf16_linear import pack_dense
    from kvserve.model.ggml_blocks import quantize
    from kvserve.model.int8_linear import Int8Linear
    from kvserve.model.quant_linear import BlockKernelLinear

    weight, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    int8, bf16 = Int8Linear(weight, None), pack_dense(weight.bfloat16(), None)
    xb = x.bfloat16()
    x8 = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=gen)
    w8 = torch.randint(-127, 128, (k, n), dtype=torch.int8, generator=gen)
    ops = 2 * m * n * k / 1e9
    blocks = BlockKernelLinear(quantize(weight * 0.1, "Q4_1"), None)
    lib = cpu_kernels.library("quant")
    rates = {"kvserve_int8": ops / _median_s(lambda: int8(x), repeats),
             "kvserve_bf16": ops / _median_s(lambda: bf16(xb), repeats),
             "onednn_int8": ops / _median_s(lambda: torch._int_mm(x8, w8), repeats),
             "q4_1_blocks": ops / _median_s(lambda: blocks(x), repeats),
             "q4_1_float32": ops / _median_s(
                 lambda: F.linear(x, blocks.decoded_by_kernel(lib)), repeats)}
    return {"m": m, "n": n, "k": k, **{f"{s}_gops": round(r, 1) for s, r in rates.items()},
            "int8_over_bf16": round(rates["kvserve_int8"] / rates["kvserve_bf16"], 2),
            "int8_of_onednn": round(rates["kvserve_int8"] / rates["onednn_int8"], 2),
            "blocks_over_float32": round(rates["q4_1_blocks"] / rates["q4_1_float32"], 2)}
