"""Rotary position embeddings in Hugging Face's rotate-half layout.

HF checkpoints store q/k projections permuted for the rotate-half form (the head's first half is
the real part, the second half the imaginary part), so applying rotary this way lets HF weights
load unchanged. Supported scalings: none, ``linear`` (positions divided by a factor) and
``llama3`` (low frequencies divided by a factor, a smooth ramp between the bands).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvserve.model import cpu_pointwise
from kvserve.model.config import ModelConfig, RopeScaling


def compute_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Per-pair inverse frequencies, float32 on CPU. Returns [head_dim // 2]."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [head_dim // 2]
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    assert scaling.rope_type == "llama3", scaling.rope_type
    # Wavelengths longer than the original context / low_freq_factor are stretched by `factor`,
    # shorter than original / high_freq_factor are kept, and the band between is interpolated.
    old_ctx = scaling.original_max_position_embeddings
    low_band = old_ctx / scaling.low_freq_factor
    high_band = old_ctx / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [head_dim // 2]
    scaled = torch.where(wavelen > low_band, inv_freq / scaling.factor, inv_freq)
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )  # [head_dim // 2]
    interpolated = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_mid_band = (wavelen >= high_band) & (wavelen <= low_band)
    return torch.where(is_mid_band, interpolated, scaled)


class RotaryEmbedding(nn.Module):
    """Maps token positions to (cos, sin) tables shared by every layer of one forward pass.

    Holds no parameters or buffers (so meta-device construction and ``load_state_dict`` never
    touch it); the float32 frequencies follow the positions' device on first use and are never
    down-cast, which keeps bf16 models' rotary angles exact.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self._inv_freq = compute_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        self._cos = torch.empty(0, config.head_dim)  # [cached positions, head_dim] float32
        self._sin = torch.empty(0, config.head_dim)  # [cached positions, head_dim] float32

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens] int -> (cos, sin), each [num_tokens, head_dim] float32.

        Rows come from a table computed once per position range (grown by doubling), so a
        step costs one gather instead of trig over every token."""
        needed = int(positions.max()) + 1 if positions.numel() else 0
        if needed > self._cos.shape[0] or self._cos.device != positions.device:
            self._grow(max(needed, 2 * self._cos.shape[0], 256), positions.device)
        return self._cos[positions], self._sin[positions]

    def _grow(self, size: int, device: torch.device) -> None:
        inv_freq = self._inv_freq.to(device)
        table = torch.arange(size, dtype=torch.float32, device=device)[:, None] * inv_freq
        angles = torch.cat((table, table), dim=-1)  # [size, head_dim]
        self._cos, self._sin = angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [num_tokens, num_heads, head_dim] by per-token angles; same shape and dtype."""
    cos = cos.to(x.dtype)[:, None, :]  # [num_tokens, 1, head_dim]
    sin = sin.to(x.dtype)[:, None, :]  # [num_tokens, 1, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [num_tokens, num_heads, hd]
    return x * cos + rotated * sin


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary`, in place through kvserve's CPU kernel where it serves the call (x is then
    overwritten and returned), else out of place (x untouched): use the result, not x."""
    rotated = cpu_pointwise.rotary_(x, cos, sin)
    return rotated if rotated is not None else apply_rotary(x, cos, sin)
