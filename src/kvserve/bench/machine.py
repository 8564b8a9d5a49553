"""`kvserve bench machine`: what this machine can do at most, the yardstick for engine figures.

Measured with the threads torch uses (`--threads`):
- GEMM rate in GFLOP/s (2*M*N*K per product) for float32 and bf16 through oneDNN with a
  prepacked weight (`mkldnn::_linear_pointwise`, the op kvserve's dense linear layers run) and
  int8 through `torch._int_mm` (int8 x int8 -> int32; on CPU ATen calls oneDNN's s8s8s32
  gemm; ONEDNN_VERBOSE=1 names the ISA each ran with), at a
  decode-sized M (few rows) and a prefill-sized one;
- memory bandwidth in GB/s: a read (a sum over a buffer far larger than the caches: what
  decoding does to weights) and a copy (read + write bytes).

Each figure is the best of `repeats` timed rounds, since other load only ever slows a round
down; on a shared machine the figures are still noisy. `weight_bytes_per_token` and
`fraction_of_limit` turn an engine's tokens/s into the share of these limits it reaches.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

GEMM_SHAPES = ((1, 2048, 2048), (16, 2048, 2048), (512, 2048, 2048))  # (M, N, K)
BANDWIDTH_BYTES = 1 << 29  # 512 MiB: far past any L3
KERNELS = {"float32": "oneDNN linear (prepacked fp32)",
           "bfloat16": "oneDNN linear (prepacked bf16, fp32 accumulation)",
           "int8": "torch._int_mm (int8 x int8 -> int32, oneDNN's s8s8s32 gemm)"}
BYTES_PER_WEIGHT = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "q4_0": 18 / 32,
                    "q4_1": 20 / 32, "q8_0": 34 / 32, "w8a8": 1.0}


@dataclass(slots=True)
class MachineLimits:
    """The measured limits: gemm[dtype][f"M={m}"] GFLOP/s, read/copy GB/s, and what ran."""

    threads: int
    gemm_gflops: dict[str, dict[str, float]] = field(default_factory=dict)
    read_gb_s: float = 0.0
    copy_gb_s: float = 0.0
    kernels: dict[str, str] = field(default_factory=dict)
    cpu: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def gemm_limit(self, dtype: str, large: bool) -> float:
        """The GEMM rate that bounds a mode computing in `dtype` (GGUF block modes compute in
        float32, w8a8 in int8): the prefill-sized M when `large`, else the decode-sized ones'
        best."""
        rates = self.gemm_gflops[dtype if dtype in ("bfloat16", "int8") else "float32"]
        values = list(rates.values())
        return values[-1] if large else max(values[:-1])


def _best_seconds(fn: Callable[[], object], repeats: int, min_seconds: float = 0.05) -> float:
    """Seconds one call takes: calls batched to at least `min_seconds`, best of `repeats`."""
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < min_seconds:
        fn()
        calls += 1
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _gemm(dtype: str, m: int, n: int, k: int, repeats: int) -> float:
    import torch

    gen = torch.Generator().manual_seed(0)
    if dtype == "int8":
        a = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=gen)  # [M, K]
        b = torch.randint(-128, 128, (k, n), dtype=torch.int8, generator=gen)  # [K, N]
        seconds = _best_seconds(lambda: torch._int_mm(a, b), repeats)
    elif dtype == "bfloat16" and not onednn_bf16():
        x = torch.randn(m, k, generator=gen).bfloat16()  # [M, K]
        w = torch.randn(n, k, generator=gen).bfloat16()  # [N, K]
        seconds = _best_seconds(lambda: torch.nn.functional.linear(x, w), repeats)
    else:
        tdt = getattr(torch, dtype)
        x = torch.randn(m, k, generator=gen).to(tdt)  # [M, K]
        w = torch.ops.mkldnn._reorder_linear_weight(
            torch.randn(n, k, generator=gen).to(tdt), None)  # [N, K], oneDNN layout
        seconds = _best_seconds(
            lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), repeats)
    return 2 * m * n * k / seconds / 1e9


def onednn_bf16() -> bool:
    """Whether oneDNN multiplies bf16 on this CPU (AVX-512 BF16/BW or AMX); elsewhere it
    refuses to pack a bf16 weight, and kvserve's `--dtype bfloat16` runs float32."""
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


BF16_FALLBACK = ("F.linear bf16 (ATen's path: this CPU lacks oneDNN's bf16 instructions, so "
                 "kvserve's --dtype bfloat16 runs float32 here)")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            line = next((ln for ln in f if ln.startswith("model name")), "")
    except OSError:
        return ""
    return line.partition(":")[2].strip()


def measure(threads: int, repeats: int = 3, bandwidth_bytes: int | None = None,
            gemm_shapes: tuple[tuple[int, int, int], ...] | None = None) -> MachineLimits:
    """Every limit, with `threads` torch threads (restored after); the bandwidth over buffers of
    `bandwidth_bytes` (default BANDWIDTH_BYTES; keep it well past the last-level cache), the
    GEMM rates at `gemm_shapes` (M, N, K; default GEMM_SHAPES, sized like a model's layers)."""
    import torch

    bandwidth_bytes = bandwidth_bytes or BANDWIDTH_BYTES
    gemm_shapes = gemm_shapes or GEMM_SHAPES
    from kvserve.bench.engine_systems import torch_threads

    limits = MachineLimits(threads=threads, kernels=dict(KERNELS), cpu=_cpu_name())
    if not onednn_bf16():
        limits.kernels["bfloat16"] = BF16_FALLBACK
    with torch_threads(threads):
        for dtype in KERNELS:
            limits.gemm_gflops[dtype] = {f"M={m}": _gemm(dtype, m, n, k, repeats)
                                         for m, n, k in gemm_shapes}
        src = torch.ones(bandwidth_bytes // 4)  # [elements] float32
        dst = torch.empty_like(src)
        limits.read_gb_s = bandwidth_bytes / _best_seconds(src.sum, repeats) / 1e9
        limits.copy_gb_s = 2 * bandwidth_bytes / _best_seconds(
            lambda: dst.copy_(src), repeats) / 1e9
    return limits


def matmul_params(config: dict[str, Any]) -> tuple[int, int]:
    """(weights of the decoder layers' projections, weights of the lm_head) of an HF config."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inter
    return per_layer * config["num_hidden_layers"], hidden * config["vocab_size"]


def weight_bytes_per_token(config: dict[str, Any], mode: str) -> float:
    """Bytes of projection and lm_head weights one decode step reads in `mode` (a dtype, a
    quantization whose lm_head is q8_0, or w8a8, whose lm_head is bf16); a step serves every
    running sequence at once."""
    layers, head = matmul_params(config)
    if mode == "w8a8":
        return layers * BYTES_PER_WEIGHT[mode] + head * BYTES_PER_WEIGHT["bfloat16"]
    if mode in ("q4_0", "q4_1", "q8_0"):
        return layers * BYTES_PER_WEIGHT[mode] + head * BYTES_PER_WEIGHT["q8_0"]
    return (layers + head) * BYTES_PER_WEIGHT[mode]


def fraction_of_limit(config: dict[str, Any], mode: str, limits: MachineLimits,
                      tokens_per_s: float, concurrency: int, total_tokens_per_s: float
                      ) -> dict[str, float]:
    """An engine run as shares of the limits: bytes of weights read per second (one read per
    decode step, `tokens_per_s / concurrency` steps a second) over the read bandwidth, and
    matmul FLOP/s (2 per weight per token, prompt and output tokens) over the GEMM rate."""
    layers, head = matmul_params(config)
    steps_per_s = tokens_per_s / max(1, concurrency)
    bytes_per_s = steps_per_s * weight_bytes_per_token(config, mode)
    flops = 2 * (layers * total_tokens_per_s + head * tokens_per_s)
    gemm = limits.gemm_limit({"bfloat16": "bfloat16", "w8a8": "int8"}.get(mode, "float32"),
                             large=concurrency > 16)
    return {"weight_gb_s": bytes_per_s / 1e9,
            "of_read_bandwidth": bytes_per_s / 1e9 / limits.read_gb_s,
            "gflops": flops / 1e9, "of_gemm_rate": flops / 1e9 / gemm}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("machine", help="this machine's GEMM rates and memory bandwidth")
    p.add_argument("--threads", type=int, default=2, help="torch threads (as bench engine)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    p.set_defaults(func=run)


def format_limits(limits: MachineLimits) -> str:
    """A few lines a person reads: GFLOP/s per dtype and M, then GB/s."""
    lines = [f"{limits.cpu or 'this CPU'}, {limits.threads} torch threads"]
    for dtype, rates in limits.gemm_gflops.items():
        cells = ", ".join(f"{m} {v:,.1f}" for m, v in rates.items())
        lines.append(f"  {dtype:8s} GEMM GFLOP/s (N=K=2048): {cells}  [{limits.kernels[dtype]}]")
    lines.append(f"  memory: read {limits.read_gb_s:.1f} GB/s, copy {limits.copy_gb_s:.1f} GB/s "
                 f"(read + write bytes; {BANDWIDTH_BYTES >> 20} MiB buffers)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.threads < 1:
        print("--threads must be at least 1")
        return 2
    limits = measure(args.threads)
    print(json.dumps(limits.as_dict()) if args.json else format_limits(limits))
    return 0
