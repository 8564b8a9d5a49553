"""The two position-wise building blocks of a Llama-family decoder: RMSNorm and the gated MLP.

Parameter names (``weight``; ``gate_proj``/``up_proj``/``down_proj``) match Hugging Face's so a
checkpoint's tensors load by name.
"""

from __future__ import annotations

from typing import TypedDict

import torch
import torch.nn.functional as F
from torch import nn


class FactoryKwargs(TypedDict):
    """Where and in which dtype a module creates its parameters (torch's factory kwargs)."""

    dtype: torch.dtype | None
    device: torch.device | str | None


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in float32, returned in the input dtype.

    The weight multiplies after the cast back, as HF does, so bf16 outputs round identically.
    """

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))  # [dim]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> [..., dim], same dtype."""
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class GatedMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)): the SwiGLU feed-forward block."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool,
                 dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        kw: FactoryKwargs = {"dtype": dtype, "device": device}
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden] -> [num_tokens, hidden]."""
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out
