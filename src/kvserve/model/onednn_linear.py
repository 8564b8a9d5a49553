"""Linear layers through oneDNN on CPUs: weights prepacked once, activations converted per call.

PyTorch's CPU `F.linear` runs on its BLAS (MKL in the official wheels), which takes a slow path
on AMD processors; oneDNN, also inside every PyTorch CPU build, does not. Measured on the 2-core
AMD EPYC (AVX-512) that runs this project's CI, fp32, 2 threads: a [32, 768] x [768, 4096]
matmul 1.44 ms with MKL, 0.77 ms with oneDNN; the 32000-row lm_head of one decode token 5.2 vs
1.5 ms. Results are fp32 with a different summation order (errors ~1e-6 relative).

`PackedLinear` holds a weight in oneDNN's blocked layout, so it is read-only: pack after the
weights are loaded and fused, and only for inference.
"""

from __future__ import annotations

import torch


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linear layers on `device` in `dtype` can run through oneDNN."""
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and dtype in (torch.float32, torch.bfloat16))


class PackedLinear:
    """y = x @ weight.T + bias, with weight [out, in] (and bias [out]) prepacked for oneDNN.

    Calls take and return ordinary dense tensors; the packed weight is a copy, so the caller
    may drop the dense one.
    """

    __slots__ = ("bias", "in_features", "out_features", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = weight.shape
        self.weight = weight.detach().contiguous().to_mkldnn()  # [out, in], oneDNN layout
        self.bias = None if bias is None else bias.detach().contiguous().to_mkldnn()  # [out]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, in] -> [num_tokens, out] (dense, x's dtype)."""
        out: torch.Tensor = torch._C._nn.mkldnn_linear(
            x.contiguous().to_mkldnn(), self.weight, self.bias).to_dense()
        return out
