"""Linear layers whose weights stay in GGUF's 4- and 8-bit blocks: decode reads 4-8x fewer bytes.

Decoding one token reads every weight once, so on a CPU its time is the weight bytes over the
memory bandwidth. Q4_0, Q4_1 and Q8_0 weights (ggml_blocks) stay packed and run, chosen at run
time by what this machine has:

1. kvserve's C kernels (csrc/quant_matmul.c for AVX-512, csrc/avx2/quant_matmul.c for AVX2):
   each block's dot product in integers: codes widened to int16 in registers, activations
   rounded to int16 per block of 32 (scale max|x| / 32767: 256 times finer than ggml's int8,
   which moved greedy tokens on real chats), the blocks' own fp16 weight scales read as the
   file holds them, float32 accumulation. From 16 rows (`kernels_take_many_rows`) the
   many-row kernels widen each group of columns once per call and run every row against it
   (csrc/quant_gemm.c with AVX512-VNNI's vpdpwssd, csrc/avx2/quant_gemm.c with vpmaddwd): the
   same numerics, faster than the float32 path below at prefill sizes (docs/benchmarks.md).
   An AVX-512 CPU without VNNI decodes the whole weight to float32 for calls of more than
   `KERNEL_MAX_TOKENS` rows (prefill) and runs a dense matmul, which reuses each decoded
   weight for every row.
2. Where those kernels are off (no AVX2 or no C compiler): PyTorch's groupwise int4 CPU op
   (`_weight_int4pack_mm_for_cpu`, group 32), vectorised by ATen for the CPU it finds. Its
   w = (q - 8) * scale + zero holds Q4_0 as (d, 0) and Q4_1 as (d, m + 8d) exactly; Q8_0 is
   split as q = 16h + l into two 4-bit halves fed [x, x]. Its fast path takes bf16 activations
   (float32 ones run a scalar loop ~100x slower, measured), so activations are rounded to bf16
   there. Torch's int8 weight-only op has one scale per output row: it cannot hold Q8_0's
   per-block scales, so it is not used.
3. The portable path, `DequantizedLinear`: the weight dequantized to float32 once and
   `F.linear` (also every other ggml type, and `kernel="portable"`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F

from kvserve.model import cpu_kernels
from kvserve.model.ggml_blocks import (
    BLOCK,
    QuantizedWeight,
    block_scales,
    dequantize,
    int4_codes,
    int8_codes,
)
from kvserve.model.onednn_linear import PackedLinear, onednn_available

__all__ = [
    "KERNELS",
    "BlockKernelLinear",
    "DequantizedLinear",
    "Int4Linear",
    "make_quantized_linear",
]

_LOG = logging.getLogger(__name__)
KERNELS = ("auto", "torch_int4", "portable")
# Rows per call every C kernel set serves; where no many-row kernel is built, more decode the
# weight whole.
KERNEL_MAX_TOKENS = 64
GEMM_MAX_TOKENS = 4096  # rows per call where the many-row kernel is built (MAX_TOKENS in C)


@functools.cache
def kernels_take_many_rows() -> bool:
    """Whether the block kernels built here run calls of any row count up to GEMM_MAX_TOKENS
    in the blocks (a many-row kernel: AVX512-VNNI or AVX2): then prefill keeps the int16
    numerics instead of decoding the weight whole to float32."""
    lib = cpu_kernels.library("quant")
    return lib is not None and lib.kvserve_quant_gemm_built() == 1


def int4_op_available() -> bool:
    """Whether this PyTorch has the groupwise int4 CPU matmul and its packing op."""
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and \
        hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


INT4_OP_ROW_MULTIPLE = 16  # torch packs output rows in groups of 16: other counts it refuses


def _out_dtype(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return out if out.dtype == like.dtype else out.to(like.dtype)


class BlockKernelLinear:
    """y = x @ w.T + bias with w's codes kept as the blocks hold them (4-bit nibbles in ggml's
    order, or int8) and one fp16 scale (and min: w = scale * q + min) per 32 weights, the
    blocks' own: one token's matmul is bound by the bytes it reads."""

    __slots__ = ("bias", "codes", "in_features", "is_q8", "min", "out_features", "scale")

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = weight.shape
        self.is_q8 = weight.ggml_type == "Q8_0"
        self.scale, self.min = block_scales(weight)  # fp16 [out, in/32] (min: Q4 only)
        if self.is_q8:
            codes8, _ = int8_codes(weight)  # [out, in]
            self.codes = codes8.to(torch.int8).contiguous()  # [out, in]
        else:
            codes, _, _ = int4_codes(weight)
            low, high = codes.view(-1, 2, 16).unbind(1)  # [out * in/32, 16] each
            self.codes = (low | (high << 4)).to(torch.uint8).view(self.out_features, -1)
            # ^ [out, in/2]: byte j of a block holds weights j (low nibble) and j + 16
        self.bias = None if bias is None else bias.detach().float().contiguous()  # [out]

    def dequantized(self) -> torch.Tensor:
        """The weight in float32 [out, in], decoded from the kept codes."""
        blocks = self.scale.shape[1]
        scale = self.scale.float().unsqueeze(-1)  # [out, in/32, 1]
        if self.is_q8:
            q = self.codes.view(self.out_features, blocks, BLOCK).float()
            return (q * scale).view(self.out_features, -1)
        nibbles = self.codes.view(self.out_features, blocks, 16)
        q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float()  # [out, in/32, 32]
        return torch.addcmul(self.min.float().unsqueeze(-1), q, scale).view(
            self.out_features, -1)

    def decoded_by_kernel(self, lib: Any) -> torch.Tensor:
        """`dequantized()` by the C kernels: one pass over the codes, no temporaries."""
        out = torch.empty(self.out_features, self.in_features)  # [out, in]
        threads = torch.get_num_threads()
        if self.is_q8:
            lib.kvserve_q8_dequantize(self.codes.data_ptr(), self.scale.data_ptr(),
                                      out.data_ptr(), self.out_features, self.in_features,
                                      threads)
        else:
            lib.kvserve_q4_dequantize(self.codes.data_ptr(), self.scale.data_ptr(),
                                      self.min.data_ptr(), out.data_ptr(), self.out_features,
                                      self.in_features, threads)
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, in] -> [num_tokens, out], x's dtype."""
        # Invariant: the kernels read float32 rows with a unit inner stride.
        lib = cpu_kernels.library("quant")
        x32 = x.float().contiguous()
        tokens = x32.shape[0]
        if lib is None:
            return _out_dtype(F.linear(x32, self.dequantized(), self.bias), x)
        if tokens > KERNEL_MAX_TOKENS and not (tokens <= GEMM_MAX_TOKENS
                                               and kernels_take_many_rows()):
            return _out_dtype(F.linear(x32, self.decoded_by_kernel(lib), self.bias), x)
        out = torch.empty(tokens, self.out_features)  # [T, out]
        threads = torch.get_num_threads()
        if self.is_q8:
            rc = lib.kvserve_q8_matmul(x32.data_ptr(), x32.stride(0), self.codes.data_ptr(),
                                       self.scale.data_ptr(), out.data_ptr(), self.out_features,
                                       tokens, self.out_features, self.in_features, threads)
        else:
            rc = lib.kvserve_q4_matmul(x32.data_ptr(), x32.stride(0), self.codes.data_ptr(),
                                       self.scale.data_ptr(), self.min.data_ptr(),
                                       out.data_ptr(), self.out_features, tokens,
                                       self.out_features, self.in_features, threads)
        if rc != 0:  # tokens are in range here, so only the activations' scratch can fail
            raise MemoryError(f"kvserve's quantized matmul could not allocate the int16 "
                              f"activations of {tokens} rows x {self.in_features}")
        if self.bias is not None:
            out += self.bias
        return _out_dtype(out, x)


class Int4Linear:
    """y = x @ w.T + bias through PyTorch's groupwise int4 op: w [out, in] as 4-bit codes and
    per-32 (scale, zero) pairs in bf16, activations in bf16, results returned in x's dtype.
    The op packs rows in groups of INT4_OP_ROW_MULTIPLE: other row counts are padded with zeros.
    `doubled`: the codes cover [x, x] (the Q8_0 split), so calls feed the input twice."""

    __slots__ = ("bias", "doubled", "in_features", "out_features", "packed", "scales_zeros")

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 bias: torch.Tensor | None, *, doubled: bool = False) -> None:
        # codes [out, k] int32 in 0..15; scale, zero [out, k/32]; k = in (or 2 * in if doubled)
        self.out_features = codes.shape[0]
        self.in_features = codes.shape[1] // 2 if doubled else codes.shape[1]
        self.doubled = doubled
        pad = -self.out_features % INT4_OP_ROW_MULTIPLE  # zero rows, sliced off each call
        if pad:
            codes, scale, zero = (F.pad(t, (0, 0, 0, pad)) for t in (codes, scale, zero))
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.contiguous(), 1)  # [out, k/2] uint8, the op's layout
        self.scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(
            torch.bfloat16).contiguous()  # [k/32, out, 2]
        self.bias = None if bias is None else bias.detach().float().contiguous()  # [out]

    @classmethod
    def from_ggml(cls, weight: QuantizedWeight, bias: torch.Tensor | None) -> Int4Linear:
        """A Q4_0, Q4_1 or Q8_0 weight, packed (ValueError for other types)."""
        if weight.ggml_type == "Q8_0":
            codes8, scale = int8_codes(weight)  # [out, in], [out, in/32]
            high, low = (codes8 >> 4) + 8, codes8 & 0x0F  # codes8 = 16 * (high - 8) + low
            codes = torch.cat([high, low], dim=1)  # [out, 2 * in]
            scales = torch.cat([16 * scale, scale], dim=1)  # [out, 2 * in/32]
            zeros = torch.cat([torch.zeros_like(scale), 8 * scale], dim=1)
            return cls(codes, scales, zeros, bias, doubled=True)
        return cls(*int4_codes(weight), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, in] -> [num_tokens, out], x's dtype."""
        xb = x.to(torch.bfloat16)
        if self.doubled:
            xb = torch.cat([xb, xb], dim=-1)  # [T, 2 * in]
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(xb.contiguous(), self.packed, BLOCK,
                                                         self.scales_zeros)  # [T, padded out]
        out = out[:, :self.out_features].float()  # [T, out]
        if self.bias is not None:
            out += self.bias
        return _out_dtype(out, x)


class DequantizedLinear:
    """The portable path: the weight dequantized to float32 once and `F.linear` (through
    oneDNN where `onednn` and available: kvserve's dense float32 path)."""

    __slots__ = ("bias", "dense", "in_features", "out_features", "packed")

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, *,
                 onednn: bool = False) -> None:
        self.out_features, self.in_features = weight.shape
        self.dense = dequantize(weight)  # [out, in] float32
        self.bias = None if bias is None else bias.detach().float().contiguous()  # [out]
        self.packed: PackedLinear | None = None
        if onednn and onednn_available(torch.device("cpu"), torch.float32):
            self.packed = PackedLinear(self.dense, self.bias)
            self.dense = self.dense.new_empty(0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, in] -> [num_tokens, out], x's dtype."""
        x32 = x.float()
        out = self.packed(x32) if self.packed is not None else F.linear(x32, self.dense,
                                                                        self.bias)
        return _out_dtype(out, x)


QuantizedLinear = BlockKernelLinear | Int4Linear | DequantizedLinear


def make_quantized_linear(weight: QuantizedWeight, bias: torch.Tensor | None = None, *,
                          kernel: str = "auto") -> QuantizedLinear:
    """The fastest layer this machine runs for `weight` ("auto": kvserve's C kernels, else
    torch's int4 op, else dequantized), or the path `kernel` names ("torch_int4", "portable").
    Types other than Q4_0/Q4_1/Q8_0 always run dequantized to float32 (through oneDNN)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    if not weight.is_packable or kernel == "portable":
        return DequantizedLinear(weight, bias, onednn=kernel == "auto")
    if kernel == "auto" and cpu_kernels.available("quant"):
        return BlockKernelLinear(weight, bias)
    if int4_op_available():
        return Int4Linear.from_ggml(weight, bias)
    _LOG.warning("neither kvserve's CPU kernels nor torch's int4 op serve %s here: it runs "
                 "dequantized to float32 (4-8x the bytes read per token)", weight.ggml_type)
    return DequantizedLinear(weight, bias, onednn=True)
