"""GGUF's quantized weight blocks as kvserve reads them: raw rows in, integer codes and scales out.

A quantized weight is `QuantizedWeight`: the ggml type's name, the logical shape [out, in] (HF's
order) and the raw bytes, one row of blocks per output feature. The three types kvserve runs
packed are read here, in torch, with no ggml code (layouts from GGUF's specification, 32 weights
a block, little-endian):

- Q4_0: fp16 d, 16 bytes of nibbles (weights 0-15 low, 16-31 high); w = d * (q - 8).
- Q4_1: fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m.
- Q8_0: fp16 d, 32 int8; w = d * q.

Every other type is dequantized to float32 through the `gguf` package (its reference decoder),
which is also how `quantize` makes blocks from dense weights (tests, and models loaded from
safetensors with `--quantization`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # weights per block in every type read here
PACKED_TYPES = ("Q4_0", "Q4_1", "Q8_0")
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """One weight matrix kept in a ggml type: `data` [out, bytes per row] uint8, the rows of
    blocks exactly as the file stores them; `shape` is the logical (out, in)."""

    ggml_type: str  # e.g. "Q4_1"; any name the gguf package knows
    shape: tuple[int, int]
    data: torch.Tensor  # [out, row_bytes] uint8

    def __post_init__(self) -> None:
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or \
                self.data.shape[0] != self.shape[0]:
            raise ValueError(f"{self.ggml_type} weight of shape {self.shape}: data must be uint8 "
                             f"[{self.shape[0]}, row bytes], got {self.data.dtype} "
                             f"{tuple(self.data.shape)}")
        width = _BLOCK_BYTES.get(self.ggml_type)
        if width is not None and self.data.shape[1] * BLOCK != self.shape[1] * width:
            raise ValueError(f"{self.ggml_type} rows of {self.shape[1]} weights take "
                             f"{self.shape[1] // BLOCK * width} bytes, got {self.data.shape[1]}")

    @property
    def is_packable(self) -> bool:
        """Whether kvserve reads this type's codes directly (the others are dequantized)."""
        return self.ggml_type in PACKED_TYPES and self.shape[1] % BLOCK == 0


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights of one type and input width along the output dim (q/k/v into one fused
    projection; blocks run along the input dim, so rows concatenate unchanged)."""
    first = weights[0]
    if any(w.ggml_type != first.ggml_type or w.shape[1] != first.shape[1] for w in weights):
        raise ValueError("only weights of one ggml type and input width concatenate")
    rows = sum(w.shape[0] for w in weights)
    return QuantizedWeight(first.ggml_type, (rows, first.shape[1]),
                           torch.cat([w.data for w in weights]))


def _blocks(weight: QuantizedWeight) -> torch.Tensor:
    out, inp = weight.shape
    return weight.data.reshape(out, inp // BLOCK, _BLOCK_BYTES[weight.ggml_type])


def _half(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian fp16 -> [...] float16, the same bytes."""
    return raw.contiguous().view(torch.float16).squeeze(-1)


def _fp16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian fp16 -> [...] float32."""
    return _half(raw).float()


def _nibbles(raw: torch.Tensor) -> torch.Tensor:
    """[out, blocks, 16] uint8 -> [out, blocks * 32] int32 codes 0..15 (low nibbles first)."""
    low, high = raw & 0x0F, raw >> 4
    return torch.cat([low, high], dim=-1).reshape(raw.shape[0], -1).to(torch.int32)


def int4_codes(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0 or Q4_1 weight as (codes [out, in] int32 in 0..15, scale, zero [out, in/32]
    float32) with w = (code - 8) * scale + zero, the form of torch's groupwise int4 op.
    Q4_0: scale d, zero 0. Q4_1: w = d*q + m = d*(q - 8) + (m + 8d), so zero = m + 8d."""
    blocks = _blocks(weight)  # [out, in/32, bytes]
    scale = _fp16(blocks[..., 0:2])  # [out, in/32]
    if weight.ggml_type == "Q4_0":
        return _nibbles(blocks[..., 2:18]), scale, torch.zeros_like(scale)
    if weight.ggml_type == "Q4_1":
        return _nibbles(blocks[..., 4:20]), scale, _fp16(blocks[..., 2:4]) + 8 * scale
    raise ValueError(f"{weight.ggml_type} is not a 4-bit type kvserve packs (Q4_0, Q4_1)")


def block_scales(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_0, Q4_1 or Q8_0 weight's (scale, min) [out, in/32] in fp16, the bytes the blocks
    hold, so w = scale * q + min with q the raw code (0..15, or -128..127 for Q8_0, whose min
    is empty). Q4_0's min is -8 * scale, exact in fp16 wherever it fits (|scale| <= 8188)."""
    blocks = _blocks(weight)  # [out, in/32, bytes]
    scale = _half(blocks[..., 0:2])
    if weight.ggml_type == "Q8_0":
        return scale, torch.empty(0, dtype=torch.float16)
    if weight.ggml_type == "Q4_1":
        return scale, _half(blocks[..., 2:4])
    if weight.ggml_type == "Q4_0":
        low = (-8 * scale.float()).half()
        if not torch.isfinite(low).all():
            raise ValueError("a Q4_0 block's scale is above 8188, so its min (-8 x scale) does "
                             "not fit fp16 and kvserve cannot keep the weight packed: load the "
                             "model without --quantization (its weights then load dequantized)")
        return scale, low
    raise ValueError(f"{weight.ggml_type} is not a type kvserve packs (Q4_0, Q4_1, Q8_0)")


def int8_codes(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 weight as (codes [out, in] int32 in -128..127, scale [out, in/32] float32)."""
    if weight.ggml_type != "Q8_0":
        raise ValueError(f"{weight.ggml_type} is not Q8_0")
    blocks = _blocks(weight)  # [out, in/32, 34]
    codes = blocks[..., 2:].contiguous().view(torch.int8).reshape(weight.shape[0], -1)
    return codes.to(torch.int32), _fp16(blocks[..., 0:2])


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The weight in float32 [out, in]: kvserve's own decoding for the packed types, the gguf
    package's for every other."""
    out, inp = weight.shape
    if weight.ggml_type == "F32":
        return weight.data.contiguous().view(torch.float32).reshape(out, inp).clone()
    if weight.ggml_type in ("Q4_0", "Q4_1"):
        codes, scale, zero = int4_codes(weight)
        grouped = (codes.float() - 8).view(out, -1, BLOCK)  # [out, in/32, 32]
        return (grouped * scale.unsqueeze(-1) + zero.unsqueeze(-1)).view(out, inp)
    if weight.ggml_type == "Q8_0":
        codes8, scale = int8_codes(weight)
        return (codes8.float().view(out, -1, BLOCK) * scale.unsqueeze(-1)).view(out, inp)
    gguf_quants, qtype = _gguf(weight.ggml_type)
    dense = gguf_quants.dequantize(weight.data.numpy(), qtype)
    return torch.from_numpy(dense.reshape(out, inp).copy()).float()


def quantize(dense: torch.Tensor, ggml_type: str) -> QuantizedWeight:
    """dense [out, in] (any float dtype) -> its ggml blocks, through the gguf package's
    reference quantizer (llama.cpp's rounding). "F32" keeps the float32 bytes (what a weight
    whose input width is not a multiple of 32 gets, as llama.cpp does)."""
    if ggml_type == "F32":
        rows = dense.detach().float().contiguous()  # [out, in]
        return QuantizedWeight("F32", (rows.shape[0], rows.shape[1]),
                               rows.view(torch.uint8).reshape(rows.shape[0], -1).clone())
    gguf_quants, qtype = _gguf(ggml_type)
    rows = gguf_quants.quantize(dense.detach().float().contiguous().numpy(), qtype)
    return QuantizedWeight(ggml_type, (dense.shape[0], dense.shape[1]), torch.from_numpy(rows))


def _gguf(ggml_type: str):  # type: ignore[no-untyped-def]
    try:
        import gguf
        from gguf import quants
    except ImportError:
        raise ValueError(f"decoding or making {ggml_type} blocks needs the gguf package: pip "
                         "install 'kvserve[engine]' (or pip install gguf)") from None
    try:
        return quants, gguf.GGMLQuantizationType[ggml_type]
    except KeyError:
        raise ValueError(f"unknown ggml type {ggml_type!r}") from None
