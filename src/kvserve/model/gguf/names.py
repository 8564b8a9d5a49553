"""GGUF tensor names -> kvserve's (Hugging Face) parameter names, and llama's Q/K row order.

llama.cpp's converter reorders the rows of every Llama/Mistral q_proj and k_proj weight inside
each head, from HF's rotate-half layout ([first halves of the pairs, second halves]) to
interleaved pairs, because its rope kernel rotates adjacent elements. ``qk_row_order`` is the
inverse: a row permutation, so it applies to dequantized rows and to packed quantized rows alike
(each row's blocks quantize that row only). Qwen2/Qwen3 files are not reordered.
"""

from __future__ import annotations

import re

import numpy as np

from kvserve.model.config import ModelConfig

PERMUTED_ARCHITECTURES = ("llama", "mistral")
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
# Tensors a GGUF may carry that kvserve derives elsewhere: llama3's rope frequency factors
# (the config's rope scaling states them), and legacy rotary buffers.
IGNORED = ("rope_freqs.weight",)


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name of a GGUF tensor, or None for a name kvserve does not know."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER[part]}.{kind}"


def qk_row_order(name: str, config: ModelConfig, architecture: str) -> np.ndarray | None:
    """For HF parameter ``name``: the GGUF row each HF row comes from (``hf = gguf[order]``),
    or None when the file stores it in HF's order. Applies to q/k weights and biases."""
    if architecture not in PERMUTED_ARCHITECTURES:
        return None
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        num_heads = config.num_attention_heads
    elif name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
        num_heads = config.num_key_value_heads
    else:
        return None
    half = config.head_dim // 2
    # GGUF row (head, i, a) at head*head_dim + 2*i + a holds HF row (head, a, i).
    order = np.arange(num_heads * config.head_dim).reshape(num_heads, half, 2)
    return order.transpose(0, 2, 1).reshape(-1)  # [num_heads * head_dim]
