"""Linear layers through oneDNN on CPUs: weights prepacked once, activations read in place.

PyTorch's CPU `F.linear` runs on its BLAS (MKL in the official wheels), which takes a slow path
on AMD processors; oneDNN, also inside every PyTorch CPU build, does not (docs/benchmarks.md,
offline engine). Results are fp32 with a different summation order (errors ~1e-6 relative).

The call goes through `mkldnn::_linear_pointwise` (the op PyTorch's own compiler emits for a
packed CPU linear): it takes and returns ordinary dense tensors, so no activation is converted
to and from oneDNN's tensor type, a conversion that costs more than the matmul on wide
activations. Builds that lack the op fall back to `mkldnn_linear` on converted activations.

`PackedLinear` holds a weight in oneDNN's blocked layout, so it is read-only: pack after the
weights are loaded and fused, and only for inference.

oneDNN builds (and PyTorch keeps) state for every row count it is called with, about an output's
worth of memory each, never released: a server whose steps carry every token count from 1 to
its batch budget would grow by gigabytes (docs/benchmarks.md, soak and chaos). So calls reach
oneDNN with few row counts: up to EXACT_ROWS as they are (decode), then padded up to a multiple
of 16 (to 64) or of 64 (to MAX_ROWS), and taller inputs in MAX_ROWS pieces: 26 row counts in all.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

EXACT_ROWS = 16  # row counts up to this reach oneDNN as they are
MAX_ROWS = 512  # taller inputs run in pieces of this many rows


def bucket_rows(rows: int) -> int:
    """The row count a call of `rows` rows (1..MAX_ROWS) reaches oneDNN with: itself up to
    EXACT_ROWS, else rounded up to a multiple of 16 (up to 64) or of 64."""
    if rows <= EXACT_ROWS:
        return rows
    step = 16 if rows <= 64 else 64
    return -(-rows // step) * step


def _has_pointwise_op() -> bool:
    try:
        return hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(
            torch.ops.mkldnn, "_reorder_linear_weight")
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()


def has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX-BF16). oneDNN also
    runs bf16 on plain AVX-512 by converting, slower than fp32."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linear layers on `device` in `dtype` can run through oneDNN (bf16 only where the
    CPU has oneDNN's bf16 instructions: elsewhere packing a bf16 weight fails at load)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


class PackedLinear:
    """y = x @ weight.T + bias, with weight [out, in] (and bias [out]) prepacked for oneDNN.

    Calls take and return ordinary dense tensors; the packed weight is a copy, so the caller
    may drop the dense one. `in_place_activations=False` forces the converting fallback path
    (what builds without `_linear_pointwise` run).
    """

    __slots__ = ("bias", "in_features", "in_place", "out_features", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *,
                 in_place_activations: bool = True) -> None:
        self.out_features, self.in_features = weight.shape
        self.in_place = in_place_activations and _has_pointwise_op()
        dense = weight.detach().contiguous()
        if self.in_place:
            # None: no batch-size hint, so oneDNN picks a layout good for every row count.
            self.weight = torch.ops.mkldnn._reorder_linear_weight(dense, None)  # [out, in]
            self.bias = None if bias is None else bias.detach().contiguous()  # [out], dense
        else:
            self.weight = dense.to_mkldnn()  # [out, in], oneDNN layout
            self.bias = None if bias is None else bias.detach().contiguous().to_mkldnn()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, in] -> [num_tokens, out] (dense, x's dtype), through oneDNN with the
        few row counts of `bucket_rows` (the module doc says why)."""
        rows = x.shape[0]
        if rows <= EXACT_ROWS:
            return self._call(x)
        pieces = []
        for start in range(0, rows, MAX_ROWS):
            part = x[start:start + MAX_ROWS]
            padded = bucket_rows(part.shape[0])
            if padded != part.shape[0]:
                part = F.pad(part, (0, 0, 0, padded - part.shape[0]))  # zero rows, dropped below
            pieces.append(self._call(part)[:min(MAX_ROWS, rows - start)])
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _call(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor
        if self.in_place:
            out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias,
                                                     "none", [], "")
        else:
            out = torch._C._nn.mkldnn_linear(
                x.contiguous().to_mkldnn(), self.weight, self.bias).to_dense()
        return out
