"""Cost profiles for real GPUs, fitted from the Splitwise simulator's measurements.

Source: perf_model.csv of the Splitwise simulator (github.com/Mutinifni/splitwise-sim, MIT,
copyright 2024 Pratyush Patel), not shipped in the repository (docs/traces.md says where to get
it). Each row is one measured batch: `prompt_size` x `batch_size` prompt tokens (`prompt_time`,
ms, to the first token) and decode steps at that batch (`token_time`, ms per step), for
Llama-2-70B on A100/H100.

The fit (documented in `fit_splitwise`; results pinned in `profiles.py`):

- prefill: below ~1k batched tokens the time is flat (launch/communication bound), so
  `prefill_floor_ms` is the median over rows with <= 256 tokens; above, a least-squares line in
  batched tokens and attention pairs over rows with >= 512 tokens, weighted by 1/time (relative
  error). A negative pair coefficient (noise: A100 batches of many short prompts are slower
  than one long prompt) is clamped to 0 and the line refitted.
- decode: least-squares line of `token_time` in batch size (weighted by 1/time).
- decode context: the CSV's contexts (<= 8.7k tokens at batch 1) change `token_time` by less
  than its noise, so this coefficient is not identifiable from it; it is set from first
  principles instead: KV bytes per token / aggregate HBM bandwidth (a decode step reads the
  whole KV of its batch once).
- `kv_capacity_tokens`: (GPUs x 80 GB x 0.9 - fp16 weights) / KV bytes per token.
"""

from __future__ import annotations

import csv
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from kvserve.sim.costmodel import CostProfile, attention_pairs

CSV_RELATIVE = "traces/splitwise_sim/perf_model.csv"
MODEL = "llama2-70b"
KV_BYTES_PER_TOKEN = 2 * 80 * 8 * 128 * 2  # K and V x 80 layers x 8 KV heads x 128 dims x fp16
WEIGHT_BYTES = 138_000_000_000  # 69B parameters in fp16
GPU_BYTES = 80_000_000_000
GPU_MEMORY_UTILIZATION = 0.9
HBM_BYTES_PER_S = {"h100-80gb": 3.35e12, "a100-80gb": 2.039e12}  # SXM datasheet bandwidths
SCHEDULER_LIMITS = (8192, 256)  # vLLM's GPU defaults: max_num_batched_tokens, max_num_seqs


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting for a small square system."""
    n = len(rhs)
    a = [row[:] + [rhs[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if a[col][col] == 0.0:
            raise ValueError("singular least-squares system: the rows do not determine the fit")
        for r in range(n):
            if r != col:
                factor = a[r][col] / a[col][col]
                a[r] = [x - factor * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[i][n] / a[i][i] for i in range(n)]


def weighted_lstsq(rows: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Coefficients minimising the sum of squared *relative* errors ((pred - y) / y)^2."""
    k = len(rows[0])
    normal = [[0.0] * k for _ in range(k)]
    rhs = [0.0] * k
    for x, target in zip(rows, y, strict=True):
        w = 1.0 / (target * target)
        for i in range(k):
            rhs[i] += w * x[i] * target
            for j in range(k):
                normal[i][j] += w * x[i] * x[j]
    return _solve(normal, rhs)


def _rel_errors(pred: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    errors = [abs(p - t) / t for p, t in zip(pred, y, strict=True)]
    return statistics.fmean(errors), max(errors)


def fit_splitwise(path: str | Path, hardware: str, tensor_parallel: int,
                  name: str | None = None) -> CostProfile:
    """Fit a `CostProfile` for Llama-2-70B on `hardware` ("h100-80gb" or "a100-80gb") with
    `tensor_parallel` GPUs from perf_model.csv. Raises ValueError when the CSV has no rows for
    that configuration."""
    with Path(path).open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["model"] == MODEL
                and r["hardware"] == hardware and int(r["tensor_parallel"]) == tensor_parallel]
    if not rows:
        raise ValueError(f"{path}: no {MODEL} rows for {hardware} with TP {tensor_parallel}")
    tokens = [int(r["prompt_size"]) * int(r["batch_size"]) for r in rows]
    pairs = [int(r["batch_size"]) * attention_pairs(0, int(r["prompt_size"])) for r in rows]
    prompt_ms = [float(r["prompt_time"]) for r in rows]
    floor = statistics.median(t for n, t in zip(tokens, prompt_ms, strict=True) if n <= 256)
    big = [i for i, n in enumerate(tokens) if n >= 512]
    base, per_token, per_pair = weighted_lstsq(
        [(1.0, tokens[i], pairs[i]) for i in big], [prompt_ms[i] for i in big])
    if per_pair < 0:
        base, per_token = weighted_lstsq([(1.0, tokens[i]) for i in big],
                                         [prompt_ms[i] for i in big])
        per_pair = 0.0
    base = max(base, 0.0)  # the floor covers small batches; a negative intercept never binds
    prefill_pred = [max(floor, base + per_token * n + per_pair * p)
                    for n, p in zip(tokens, pairs, strict=True)]

    batch = [int(r["batch_size"]) for r in rows]
    token_ms = [float(r["token_time"]) for r in rows]
    decode_base, per_seq = weighted_lstsq([(1.0, b) for b in batch], token_ms)
    per_context = KV_BYTES_PER_TOKEN / (tensor_parallel * HBM_BYTES_PER_S[hardware]) * 1000.0
    context = [b * (int(r["prompt_size"]) + int(r["token_size"]) / 2) for b, r in zip(
        batch, rows, strict=True)]
    decode_pred = [decode_base + per_seq * b + per_context * c
                   for b, c in zip(batch, context, strict=True)]

    pre_mean, pre_max = _rel_errors(prefill_pred, prompt_ms)
    dec_mean, dec_max = _rel_errors(decode_pred, token_ms)
    kv_bytes = tensor_parallel * GPU_BYTES * GPU_MEMORY_UTILIZATION - WEIGHT_BYTES
    gpu = hardware.split("-")[0]
    return CostProfile(
        name=name or f"{gpu}-tp{tensor_parallel}",
        source=(f"Splitwise perf_model.csv (MIT, (c) 2024 Pratyush Patel): {MODEL} on "
                f"{tensor_parallel}x {hardware}, {len(rows)} rows"),
        prefill_floor_ms=round(floor, 4),
        prefill_base_ms=round(base, 4),
        prefill_ms_per_token=round(per_token, 8),
        prefill_ms_per_pair=round(per_pair, 12),
        decode_base_ms=round(decode_base, 4),
        decode_ms_per_seq=round(per_seq, 6),
        decode_ms_per_context_token=round(per_context, 10),
        kv_capacity_tokens=int(kv_bytes // KV_BYTES_PER_TOKEN),
        max_num_batched_tokens=SCHEDULER_LIMITS[0],
        max_num_seqs=SCHEDULER_LIMITS[1],
        fit={"rows": float(len(rows)),
             "prefill_mean_rel_err": round(pre_mean, 4), "prefill_max_rel_err": round(pre_max, 4),
             "decode_mean_rel_err": round(dec_mean, 4), "decode_max_rel_err": round(dec_max, 4)},
    )


def main(argv: Sequence[str]) -> int:
    """`python -m kvserve.sim.splitwise_fit CSV HARDWARE TP`: print the fitted profile."""
    if len(argv) != 3:
        print("usage: python -m kvserve.sim.splitwise_fit perf_model.csv h100-80gb 4",
              file=sys.stderr)
        return 2
    print(fit_splitwise(argv[0], argv[1], int(argv[2])).to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
