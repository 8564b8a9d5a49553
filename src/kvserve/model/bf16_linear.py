"""bfloat16 linear layers through kvserve's AVX512-BF16 kernel (csrc/bf16_matmul.c), and the
choice between it and oneDNN for a dense weight.

oneDNN's bf16 matmuls are slowest where decoding runs them, at 1-16 rows of narrow (K=576)
weights (docs/benchmarks.md has the measurements). On CPUs whose bf16 arithmetic is
AVX512-BF16 dot products (no AMX: AMX tiles are oneDNN's, and faster), bf16 weights are packed
for kvserve's kernel, which keeps a tile's 24 accumulators in registers over all of K.
Products of bf16 pairs are exact in float32 and accumulate in float32, as oneDNN's do; the
results differ from oneDNN's by summation order, then one rounding to bf16.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kvserve.model import cpu_kernels
from kvserve.model.onednn_linear import PackedLinear, cpu_flags

__all__ = ["Bf16Linear", "kernel_serves_bf16", "pack_dense"]

GROUP = 64  # columns a packed group holds (GROUP in bf16_matmul.c)


@functools.cache
def _built_with_bf16() -> bool:
    """Whether the loaded kernels include the AVX512-BF16 matmul (a build for a CPU without
    those instructions has a stub that returns -1)."""
    lib = cpu_kernels.library("bf16_matmul")
    if lib is None:
        return False
    x = torch.zeros(1, 2, dtype=torch.bfloat16)
    packed = torch.zeros(GROUP * 2, dtype=torch.bfloat16)
    y = torch.empty(1, 1)
    return lib.kvserve_bf16_matmul(x.data_ptr(), 2, 1, packed.data_ptr(), 1, 2, None,
                                   y.data_ptr(), 1, 0, 1) == 0


def kernel_serves_bf16() -> bool:
    """Whether bf16 weights go to kvserve's kernel here: AVX512-BF16 built in, no AMX."""
    return (cpu_kernels.library("bf16_matmul") is not None and "amx_bf16" not in cpu_flags()
            and _built_with_bf16())


def pack_dense(weight: torch.Tensor, bias: torch.Tensor | None) -> Bf16Linear | PackedLinear:
    """The packed op for a dense weight [out, in] (and bias [out]): kvserve's kernel for bf16
    weights where it serves (`kernel_serves_bf16`), else oneDNN's `PackedLinear`."""
    if (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and kernel_serves_bf16()):
        return Bf16Linear(weight, bias)
    return PackedLinear(weight, bias)


class Bf16Linear:
    """y = x @ weight.T + bias for bf16 x [T, in] -> bf16 [T, out], weight [out, in] packed for
    bf16_matmul.c (columns zero-padded to a multiple of GROUP, k pairs interleaved); the bias is
    kept in float32 and added before the one rounding. Read-only: inference only."""

    __slots__ = ("bias", "in_features", "out_features", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        out_features, in_features = weight.shape
        self.out_features, self.in_features = out_features, in_features
        padded_out = -(-out_features // GROUP) * GROUP
        padded_in = in_features + in_features % 2
        w = F.pad(weight.detach().to(torch.bfloat16),
                  (0, padded_in - in_features, 0, padded_out - out_features))
        # [groups, GROUP, in/2, 2] -> [groups, in/2, GROUP, 2]: each k pair's columns together.
        self.packed = w.view(padded_out // GROUP, GROUP, padded_in // 2, 2).permute(
            0, 2, 1, 3).contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] (bf16; other dtypes and layouts are converted first) -> [T, out] bf16."""
        return self._run(x, torch.bfloat16)

    def float_output(self, x: torch.Tensor) -> torch.Tensor:
        """The same product before its rounding: x [T, in] -> [T, out] float32."""
        return self._run(x, torch.float32)

    def _run(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(-1) != 1:
            x = x.to(torch.bfloat16).reshape(-1, self.in_features).contiguous()
        if self.in_features % 2:
            x = F.pad(x, (0, 1))
        out = torch.empty(x.shape[0], self.out_features, dtype=out_dtype)
        if not x.shape[0]:
            return out
        lib = cpu_kernels.library("bf16_matmul")
        assert lib is not None, "Bf16Linear is built only where the kernel serves"
        status = lib.kvserve_bf16_matmul(
            x.data_ptr(), x.stride(0), x.shape[0], self.packed.data_ptr(), self.out_features,
            self.packed.shape[1] * 2, None if self.bias is None else self.bias.data_ptr(),
            out.data_ptr(), self.out_features, int(out_dtype == torch.bfloat16),
            torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"kvserve's bf16 matmul kernel failed (status {status})")
        return out
