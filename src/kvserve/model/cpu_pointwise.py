"""kvserve's fused position-wise CPU kernels (csrc/pointwise.c, csrc/avx2/pointwise.c) through
ctypes, for float32 and bfloat16 activations (computed in float32).

Each replaces a chain of PyTorch eager ops that passes over the activations several times
(RMSNorm: square, mean, rsqrt, two multiplies, and the residual add before it; SwiGLU's gate:
silu, then a multiply; rotary: slicing, a negation, a concatenation, two multiplies and an add)
with one pass. Each function returns None where the kernels do not serve the call (see
cpu_kernels; another dtype or device, a dim that is not a multiple of the set's vector width
(16 lanes with AVX-512, 8 with AVX2), or a layout the kernel does not read), and callers then
take their PyTorch path, the reference. Results equal the PyTorch ops up to float rounding
(other summation and evaluation orders). In bf16 the kernels round where the PyTorch ops round
(RMSNorm and SwiGLU: each intermediate PyTorch keeps in bf16), except rotary, which rounds its
result once (PyTorch's path rounds the tables and each step).
"""

from __future__ import annotations

import torch

from kvserve.model import cpu_kernels

__all__ = ["add_rms_norm", "rms_norm", "rotary_", "silu_mul"]


_DTYPES = (torch.float32, torch.bfloat16)


def _served(*tensors: torch.Tensor) -> bool:
    """Whether the kernels read these tensors: on the CPU, one dtype they take, last dim
    contiguous."""
    dtype = tensors[0].dtype
    return dtype in _DTYPES and all(
        t.device.type == "cpu" and t.dtype == dtype and t.dim() >= 1 and t.stride(-1) == 1
        for t in tensors)


def _is_bf16(x: torch.Tensor) -> int:
    return int(x.dtype == torch.bfloat16)


def _rows(x: torch.Tensor) -> tuple[int, int] | None:
    """(rows, row stride) of x viewed as [rows, last dim], or None when rows are not evenly
    strided (the kernels walk rows by one stride)."""
    if x.dim() == 1:
        return 1, x.shape[0]
    if x.dim() != 2:
        return None
    return x.shape[0], x.stride(0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * x / sqrt(mean(x^2, -1) + eps) for x [T, dim] -> new [T, dim]; None if unserved."""
    lib = cpu_kernels.library("pointwise")
    rows = _rows(x)
    if lib is None or rows is None or not _served(x, weight) or not weight.is_contiguous():
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    tokens, stride = rows
    dim = x.shape[-1]
    status = lib.kvserve_rms_norm(x.data_ptr(), stride, None, 0, weight.data_ptr(),
                                  out.data_ptr(), dim, tokens, dim, eps, torch.get_num_threads(),
                                  _is_bf16(x))
    return out if status == 0 else None


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(s, rms_norm(s)) with s = residual + delta, both [T, dim]; s is written into `delta`
    (which the caller gives up) and returned. None if unserved (nothing written then)."""
    lib = cpu_kernels.library("pointwise")
    res_rows, delta_rows = _rows(residual), _rows(delta)
    if (lib is None or res_rows is None or delta_rows is None or residual.shape != delta.shape
            or not _served(residual, delta, weight) or not weight.is_contiguous()):
        return None
    out = torch.empty(delta.shape, dtype=delta.dtype)
    dim = delta.shape[-1]
    # The kernel adds its first operand into its second, in place: `delta` receives the sum.
    status = lib.kvserve_rms_norm(residual.data_ptr(), res_rows[1], delta.data_ptr(),
                                  delta_rows[1], weight.data_ptr(), out.data_ptr(), dim,
                                  res_rows[0], dim, eps, torch.get_num_threads(),
                                  _is_bf16(delta))
    return (delta, out) if status == 0 else None


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for gate_up [T, 2 * dim] (gate first) -> new [T, dim]; None if unserved."""
    lib = cpu_kernels.library("pointwise")
    rows = _rows(gate_up)
    if lib is None or rows is None or not _served(gate_up) or gate_up.shape[-1] % 2:
        return None
    dim = gate_up.shape[-1] // 2
    tokens, stride = rows
    out = torch.empty(*gate_up.shape[:-1], dim, dtype=gate_up.dtype)
    status = lib.kvserve_silu_mul(gate_up.data_ptr(), stride, out.data_ptr(), dim, tokens, dim,
                                  torch.get_num_threads(), _is_bf16(gate_up))
    return out if status == 0 else None


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Rotate x [T, heads, head_dim] in place by cos/sin [T, head_dim] (RotaryEmbedding's
    float32 tables, whose two halves are equal) and return it; None if unserved (x
    untouched)."""
    lib = cpu_kernels.library("pointwise")
    if (lib is None or x.dim() != 3 or not _served(x) or not _served(cos, sin)
            or cos.dtype != torch.float32 or not cos.is_contiguous()
            or not sin.is_contiguous() or cos.shape != (x.shape[0], x.shape[2])
            or sin.shape != cos.shape):
        return None
    tokens, heads, head_dim = x.shape
    status = lib.kvserve_rotary(x.data_ptr(), x.stride(0), x.stride(1), tokens, heads,
                                head_dim, cos.data_ptr(), sin.data_ptr(),
                                torch.get_num_threads(), _is_bf16(x))
    return x if status == 0 else None
