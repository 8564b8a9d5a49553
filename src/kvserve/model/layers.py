"""The two position-wise building blocks of a Llama-family decoder: RMSNorm and the gated MLP.

Parameter names (``weight``; ``gate_proj``/``up_proj``/``down_proj``) match Hugging Face's so a
checkpoint's tensors load by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypedDict

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model import cpu_pointwise
from kvserve.model.bf16_linear import pack_dense

LinearOp = Callable[[torch.Tensor], torch.Tensor]  # x [T, in] -> [T, out]: a packed projection


class FactoryKwargs(TypedDict):
    """Where and in which dtype a module creates its parameters (torch's factory kwargs)."""

    dtype: torch.dtype | None
    device: torch.device | str | None


class ProjectionDeltas(Protocol):
    """Adds per-row deltas (LoRA adapters, kvserve.model.lora) after a base projection:
    `outs` are views of the output slices of the fused projection `kind` ("qkv", "o",
    "gate_up", "down") computed from x [T, in]; they are updated in place."""

    def add(self, kind: str, x: torch.Tensor, outs: Sequence[torch.Tensor]) -> None: ...


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
        fast = cpu_pointwise.rms_norm(x, self.weight, self.eps)
        if fast is not None:
            return fast
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_and_norm(self, residual: torch.Tensor,
                     delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, this norm of it), both [T, dim]: the pre-norm block's residual add
        and the norm after it, in one pass where kvserve's CPU kernel serves the call (the sum
        is then written into `delta`, which the caller gives up)."""
        fused = cpu_pointwise.add_rms_norm(residual, delta, self.weight, self.eps)
        if fused is not None:
            return fused
        total = residual + delta
        return total, self(total)


def drop_dense(*linears: nn.Linear) -> None:
    """Free the dense weights (and biases) of layers now served from packed copies."""
    for linear in linears:
        linear.weight.data = linear.weight.data.new_empty(0)
        if linear.bias is not None:
            linear.bias.data = linear.bias.data.new_empty(0)


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

        self.gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.packed_gate_up: LinearOp | None = None
        self.packed_down: LinearOp | None = None
        self.lora: ProjectionDeltas | None = None  # LoRA adapters' deltas, when served

    def pack(self, gate_up: LinearOp | None = None, down: LinearOp | None = None) -> None:
        """Serve the fused gate/up and down_proj from packed weights (after `fuse`): the given
        ops (e.g. quantized ones), else packed copies of the dense weights (`pack_dense`: oneDNN's
        or kvserve's bf16 kernel's), which are dropped either way: inference only from here on."""
        assert self.gate_up is not None, "fuse before packing"
        self.packed_gate_up = gate_up or pack_dense(*self.gate_up)
        self.packed_down = down or pack_dense(self.down_proj.weight, self.down_proj.bias)
        self.gate_up = None
        drop_dense(self.gate_proj, self.up_proj, self.down_proj)

    def fuse(self) -> None:
        """Compute gate and up in one matmul. The two weights become views of one tensor, so
        values (and memory) are unchanged; call after the weights are loaded and placed."""
        weight = torch.cat([self.gate_proj.weight, self.up_proj.weight])  # [2 * inter, hidden]
        size = self.gate_proj.weight.shape[0]
        self.gate_proj.weight.data, self.up_proj.weight.data = weight[:size], weight[size:]
        bias = None
        if self.gate_proj.bias is not None and self.up_proj.bias is not None:
            bias = torch.cat([self.gate_proj.bias, self.up_proj.bias])  # [2 * inter]
            self.gate_proj.bias.data, self.up_proj.bias.data = bias[:size], bias[size:]
        self.gate_up = (weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden] -> [num_tokens, hidden]."""
        if self.lora is not None:
            return self._forward_with_deltas(x, self.lora)
        if self.packed_gate_up is not None and self.packed_down is not None:
            return self.packed_down(_silu_mul(self.packed_gate_up(x)))
        if self.gate_up is None:
            out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
            return out
        fused: torch.Tensor = self.down_proj(_silu_mul(F.linear(x, *self.gate_up)))
        return fused


    def _forward_with_deltas(self, x: torch.Tensor, lora: ProjectionDeltas) -> torch.Tensor:
        """`forward` with the deltas added to gate/up and down after their base matmuls."""
        if self.packed_gate_up is not None:
            gate_up = self.packed_gate_up(x)  # [T, 2 * inter]
        elif self.gate_up is not None:
            gate_up = F.linear(x, *self.gate_up)  # [T, 2 * inter]
        else:
            gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)  # [T, 2 * inter]
        lora.add("gate_up", x, gate_up.chunk(2, dim=-1))
        inner = _silu_mul(gate_up)  # [T, inter]
        out: torch.Tensor = (self.packed_down(inner) if self.packed_down is not None
                             else self.down_proj(inner))  # [T, hidden]
        lora.add("down", inner, (out,))
        return out


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [T, 2 * inter] (gate first) -> [T, inter]: one pass through
    kvserve's CPU kernel where it serves the call."""
    fast = cpu_pointwise.silu_mul(gate_up)
    if fast is not None:
        return fast
    gate, up = gate_up.chunk(2, dim=-1)  # [T, inter] each
    return F.silu(gate) * up
