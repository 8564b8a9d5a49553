"""Serve a loaded model's projections from weights kept in GGUF's blocks (quant_linear).

`pack_quantized` is the quantized twin of `LlamaForCausalLM.pack_for_onednn`: applied once
after loading (and `fuse_projections`), it replaces q/k/v (fused), o_proj, gate/up (fused),
down_proj and the lm_head with packed layers and drops their dense weights. The blocks come in
per Hugging Face parameter name (`model.layers.0.self_attn.q_proj.weight`, ...), as
`gguf_weights` reads them from a .gguf file (Q and K rows already in HF's order) or as
`quantize_weights` makes them from the dense weights. The embeddings stay dense: a lookup
reads one row a token.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from kvserve.model.config import ModelConfig
from kvserve.model.decode_step import FusedDecode
from kvserve.model.ggml_blocks import BLOCK, QuantizedWeight, concat_rows, dequantize, quantize
from kvserve.model.layers import LinearOp, drop_dense
from kvserve.model.llama import DecoderLayer, LlamaForCausalLM
from kvserve.model.onednn_linear import PackedLinear, onednn_available
from kvserve.model.quant_linear import make_quantized_linear

QUANTIZATIONS = ("q4_0", "q4_1", "q8_0")  # --quantization: every projection in this type
LM_HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"


def _projection_names(i: int) -> dict[str, str]:
    attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
    return {p: attn + p + ".weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")} | \
        {p: mlp + p + ".weight" for p in ("gate_proj", "up_proj", "down_proj")}


def quantize_weights(model: LlamaForCausalLM, ggml_type: str,
                     lm_head_type: str = "Q8_0") -> dict[str, QuantizedWeight]:
    """Every projection's dense weight in `ggml_type` blocks, the lm_head's in `lm_head_type`
    (GGUF files keep the output/embedding matrix at 8 bits too), keyed by HF name; a weight
    whose input width is not a multiple of 32 stays float32 ("F32")."""

    def blocks(weight: torch.Tensor, wanted: str) -> QuantizedWeight:
        return quantize(weight, wanted if weight.shape[1] % BLOCK == 0 else "F32")

    weights = {}
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer, DecoderLayer)
        modules = {"q_proj": layer.self_attn.q_proj, "k_proj": layer.self_attn.k_proj,
                   "v_proj": layer.self_attn.v_proj, "o_proj": layer.self_attn.o_proj,
                   "gate_proj": layer.mlp.gate_proj, "up_proj": layer.mlp.up_proj,
                   "down_proj": layer.mlp.down_proj}
        for short, name in _projection_names(i).items():
            weights[name] = blocks(modules[short].weight, ggml_type)
    weights[LM_HEAD] = blocks(model.lm_head.weight, lm_head_type)
    return weights


def gguf_weights(path: Path, config: ModelConfig) -> dict[str, QuantizedWeight]:
    """A .gguf file's matrices in their own blocks, by HF name (kvserve.model.gguf's
    `packed_weights`: q/k rows already in HF order), copied out of the mapped file."""
    from kvserve.model.gguf import packed_weights

    return {name: QuantizedWeight(p.ggml_type.name, p.shape,
                                  torch.from_numpy(np.array(p.data, copy=True)))
            for name, p in packed_weights(path, config).items()}


def _linear(parts: list[QuantizedWeight], bias: torch.Tensor | None, kernel: str) -> LinearOp:
    """One packed layer for the row-concatenation of `parts` (fused projections); parts of
    mixed ggml types run dequantized to float32."""
    if len({(w.ggml_type, w.shape[1]) for w in parts}) == 1:
        return make_quantized_linear(concat_rows(parts), bias, kernel=kernel)
    dense = torch.cat([dequantize(w) for w in parts])  # [sum of out, in]
    if kernel == "auto" and onednn_available(torch.device("cpu"), torch.float32):
        return PackedLinear(dense, bias)
    return lambda x: torch.nn.functional.linear(x.float(), dense, bias).to(x.dtype)


def pack_quantized(model: LlamaForCausalLM, weights: Mapping[str, QuantizedWeight], *,
                   kernel: str = "auto") -> None:
    """Serve every projection and the lm_head from `weights` (see quant_linear for `kernel`);
    call once, after `fuse_projections`, on a single-rank CPU model. Raises ValueError naming a
    missing or misshapen weight."""
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer, DecoderLayer)
        names = _projection_names(i)
        attn, mlp = layer.self_attn, layer.mlp
        dense = {"q_proj": attn.q_proj, "k_proj": attn.k_proj, "v_proj": attn.v_proj,
                 "o_proj": attn.o_proj, "gate_proj": mlp.gate_proj, "up_proj": mlp.up_proj,
                 "down_proj": mlp.down_proj}
        got = {short: _lookup(weights, name, tuple(dense[short].weight.shape))
               for short, name in names.items()}
        assert attn.qkv is not None and mlp.gate_up is not None, "fuse before packing"
        attn.pack(_linear([got["q_proj"], got["k_proj"], got["v_proj"]], attn.qkv[1], kernel),
                  _linear([got["o_proj"]], attn.o_proj.bias, kernel))
        mlp.pack(_linear([got["gate_proj"], got["up_proj"]], mlp.gate_up[1], kernel),
                 _linear([got["down_proj"]], mlp.down_proj.bias, kernel))
    shape = tuple(model.lm_head.weight.shape)
    head = weights.get(LM_HEAD) or (weights.get(EMBED) if model.config.tie_word_embeddings
                                    else None)
    if head is None:
        raise ValueError(f"no quantized {LM_HEAD} (nor tied {EMBED}) among the weights")
    model.packed_lm_head = _linear([_lookup({LM_HEAD: head}, LM_HEAD, shape)], None, kernel)
    if not model.config.tie_word_embeddings:
        drop_dense(model.lm_head)
    model.model.fused_decode = FusedDecode.build(model.model)


def _lookup(weights: Mapping[str, QuantizedWeight], name: str,
            shape: tuple[int, ...]) -> QuantizedWeight:
    weight = weights.get(name)
    if weight is None:
        raise ValueError(f"no quantized weight for {name}; the blocks must cover every "
                         "projection of the model")
    if weight.shape != shape:
        raise ValueError(f"{name}: quantized shape {weight.shape}, the model expects {shape}")
    return weight
