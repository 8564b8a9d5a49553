"""ModelConfig from a GGUF file's metadata (llama.cpp's ``{arch}.*`` keys) and tensor list.

The metadata is translated into the Hugging Face config dict it stands for and validated by
``ModelConfig.from_dict``, so a GGUF and the safetensors checkpoint it was converted from get the
same config through the same checks. Facts the metadata leaves implicit come from the tensors:
tied embeddings (no ``output.weight``), attention and MLP biases.
"""

from __future__ import annotations

from typing import Any

from kvserve.model.config import ModelConfig
from kvserve.model.errors import ModelLoadError
from kvserve.model.gguf.reader import GGUFFile

HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_NORM_EPS = 1e-5  # llama.cpp's default when a file omits it


def config_from_gguf(gguf_file: GGUFFile) -> ModelConfig:
    """The architecture this file describes; ModelLoadError naming the key or architecture that
    kvserve cannot serve."""
    return ModelConfig.from_dict(hf_config_dict(gguf_file), source=str(gguf_file.path))


def hf_config_dict(gguf_file: GGUFFile) -> dict[str, Any]:
    """The HF ``config.json`` contents equivalent to the file's metadata."""
    arch = gguf_file.architecture
    if arch not in HF_ARCHITECTURES:
        raise ModelLoadError(f"{gguf_file.path}: GGUF architecture {arch!r} is not supported; "
                             f"kvserve serves {', '.join(HF_ARCHITECTURES)} GGUF files")
    meta = gguf_file.metadata
    source = gguf_file.path

    def key(name: str, default: Any = ...) -> Any:
        full = f"{arch}.{name}"
        if full in meta:
            return meta[full]
        if default is ...:
            raise ModelLoadError(f"{source}: metadata key '{full}' is missing; a {arch} GGUF "
                                 "needs it")
        return default

    num_heads = key("attention.head_count")
    hidden = key("embedding_length")
    head_dim = key("attention.key_length", None)
    if head_dim is None and isinstance(num_heads, int) and num_heads > 0:
        head_dim = hidden // num_heads
    rotary_dims = key("rope.dimension_count", head_dim)
    if rotary_dims != head_dim:
        raise ModelLoadError(f"{source}: '{arch}.rope.dimension_count' is {rotary_dims} but "
                             f"head_dim is {head_dim}; kvserve rotates whole heads only")
    tensors = gguf_file.tensors
    raw: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURES[arch]],
        "vocab_size": key("vocab_size", None) or _vocab_size(gguf_file),
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": key("attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", _DEFAULT_RMS_NORM_EPS),
        "rope_theta": key("rope.freq_base", _DEFAULT_ROPE_THETA),
        "max_position_embeddings": key("context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_gate.bias" in tensors,
        "hidden_act": "silu",
        "dtype": "float32",  # dequantized values are exact in float32
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_token_ids(meta),
    }
    if arch == "mistral":
        raw["sliding_window"] = key("attention.sliding_window", None)
    raw["rope_scaling"] = _rope_scaling(gguf_file, key)
    return raw


def eos_token_ids(meta: dict[str, Any]) -> list[int]:
    """The ids that end a generation: eos, then eot (end of turn) when it differs."""
    ids: list[int] = []
    for name in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        value = meta.get(name)
        if isinstance(value, int) and value not in ids:
            ids.append(value)
    return ids


def _vocab_size(gguf_file: GGUFFile) -> int:
    tokens = gguf_file.metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list):
        return len(tokens)
    embed = gguf_file.tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"{gguf_file.path}: no vocab_size, tokenizer or token_embd.weight "
                             "to size the vocabulary from")
    return embed.shape[0]


def _rope_scaling(gguf_file: GGUFFile, key: Any) -> dict[str, Any] | None:
    kind = key("rope.scaling.type", "none")
    if "rope_freqs.weight" in gguf_file.tensors:
        raise ModelLoadError(f"{gguf_file.path}: carries per-frequency rope factors "
                             "(rope_freqs.weight, Llama 3.1-style rope scaling) that its "
                             "metadata does not state; pass the original model's config with "
                             "--hf-config-path DIR (hf_config_path=) to serve it")
    if kind in ("none", None):
        return None
    if kind != "linear":
        raise ModelLoadError(f"{gguf_file.path}: rope scaling {kind!r} is not supported; "
                             "kvserve supports linear (and llama3 via --hf-config-path)")
    return {"rope_type": "linear", "factor": key("rope.scaling.factor")}
