"""int8 x int8 linear layers (`--quantization w8a8`): where a CPU multiplies int8 about twice as
fast as bf16 (AVX512-VNNI), batched decode and prefill are bound by that rate, not by reading
weights.

Numerics (`Int8Linear`): the weight is int8 per output channel (scale max|w| / 127, round to
nearest even), each activation row int8 per block of ACT_BLOCK inputs (scale max|x| / 127), so
an outlier coarsens only the 32 inputs around it: per-token scales (one per row, the common
W8A8 recipe) gave 7x Q8_0's logit error on SmolLM2, per-32 blocks about 2x
(docs/benchmarks.md). Each block's dot product is exact in int32 and is scaled and summed in
float32. Two paths compute it: kvserve's kernel (csrc/int8_matmul.c, AVX512-VNNI, chosen at
run time) and a portable PyTorch one with the same rounding (every other CPU, and the tests'
reference), which dequantizes both sides and runs a float32 matmul.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kvserve.model import cpu_kernels

__all__ = ["ACT_BLOCK", "Int8Linear", "int8_kernel_serves", "quantize_activations"]

ACT_BLOCK = 32  # inputs an activation scale covers (ABLK in int8_matmul.c)
GROUP = 32  # columns a packed group holds (GROUP in int8_matmul.c)


@functools.cache
def int8_kernel_serves() -> bool:
    """Whether kvserve's VNNI kernel runs here (the build for a CPU without AVX512-VNNI has a
    stub that returns -3)."""
    lib = cpu_kernels.library("int8_matmul")
    if lib is None:
        return False
    x = torch.zeros(1, ACT_BLOCK)
    packed = torch.zeros(GROUP * ACT_BLOCK, dtype=torch.uint8)
    scales, y = torch.zeros(GROUP), torch.empty(1, 1)
    return lib.kvserve_i8_matmul(x.data_ptr(), ACT_BLOCK, 0, 1, packed.data_ptr(),
                                 scales.data_ptr(), 1, ACT_BLOCK, None, y.data_ptr(), 1, 0,
                                 1) == 0


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (K a multiple of ACT_BLOCK) -> int8 codes as float32 [T, K/32, 32] and their
    scales [T, K/32, 1]: the kernel's rounding (to nearest even, |q| <= 127)."""
    blocks = x.float().reshape(x.shape[0], -1, ACT_BLOCK)
    peak = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(peak > 0, 127.0 / peak, torch.zeros_like(peak))
    return torch.round(blocks * inverse), peak / 127.0


class Int8Linear:
    """y = x @ weight.T + bias with weight int8 per output channel and x int8 per block of 32
    (module doc); x bf16 or float32 [T, in] -> [T, out] in x's dtype (others run in float32).
    Read-only: inference only. in_features must be a multiple of ACT_BLOCK (ValueError)."""

    __slots__ = ("bias", "codes", "in_features", "out_features", "packed", "scales")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = weight.shape
        if self.in_features % ACT_BLOCK:
            raise ValueError(f"int8 linear layers need in_features divisible by {ACT_BLOCK}, "
                             f"got {self.in_features}; serve this model without w8a8")
        w = weight.detach().float()
        scales = w.abs().amax(1) / 127.0  # [out]
        codes = torch.round(w / torch.where(scales > 0, scales, 1.0)[:, None]).clamp(-127, 127)
        self.codes = codes.to(torch.int8)  # [out, in]: the portable path's operand
        self.scales = scales.contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()  # [out]
        self.packed: torch.Tensor | None = None
        if int8_kernel_serves():
            padded = -(-self.out_features // GROUP) * GROUP
            unsigned = (F.pad(codes, (0, 0, 0, padded - self.out_features)) + 128).to(
                torch.uint8)
            # [groups, GROUP, in/4, 4] -> [groups, in/4, GROUP, 4]: each k quad's columns
            # together, so one 64-byte load feeds 16 columns.
            self.packed = unsigned.view(padded // GROUP, GROUP, -1, 4).permute(
                0, 2, 1, 3).contiguous()
            self.scales = F.pad(self.scales, (0, padded - self.out_features))
            self.codes = self.codes.new_empty(0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out], x's dtype (bf16 or float32; others computed in float32)."""
        dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float32) else torch.float32
        if x.dtype != dtype or x.dim() != 2 or x.stride(-1) != 1:
            x = x.to(dtype).reshape(-1, self.in_features).contiguous()
        if self.packed is None:
            return self.portable(x).to(dtype)
        out = torch.empty(x.shape[0], self.out_features, dtype=dtype)
        if not x.shape[0]:
            return out
        lib = cpu_kernels.library("int8_matmul")
        assert lib is not None, "packed only where the kernel serves"
        bf16 = int(dtype == torch.bfloat16)
        status = lib.kvserve_i8_matmul(
            x.data_ptr(), x.stride(0), bf16, x.shape[0], self.packed.data_ptr(),
            self.scales.data_ptr(), self.out_features, self.in_features,
            None if self.bias is None else self.bias.data_ptr(), out.data_ptr(),
            self.out_features, bf16, torch.get_num_threads())
        if status == -1:
            raise MemoryError(f"kvserve's int8 matmul could not allocate the int8 activations "
                              f"of {x.shape[0]} rows x {self.in_features}")
        if status != 0:
            raise RuntimeError(f"kvserve's int8 matmul kernel failed (status {status})")
        return out

    def portable(self, x: torch.Tensor) -> torch.Tensor:
        """The same numerics in PyTorch: x [T, in] -> float32 [T, out]."""
        codes, scales = quantize_activations(x)
        weight = self.weight_codes().float()
        out = F.linear((codes * scales).view(x.shape[0], -1), weight)
        out = out * self.scales[:self.out_features]
        return out if self.bias is None else out + self.bias

    def weight_codes(self) -> torch.Tensor:
        """The int8 codes [out, in], from the packed copy where the kernel holds them."""
        if self.packed is None:
            return self.codes
        unsigned = self.packed.permute(0, 2, 1, 3).reshape(-1, self.in_features)
        return (unsigned[:self.out_features].to(torch.int16) - 128).to(torch.int8)
