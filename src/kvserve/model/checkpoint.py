"""Write valid Hugging Face checkpoint directories from deterministic random weights.

Used for the built-in demo model of ``kvserve serve`` (no download) and for test fixtures. Needs
torch, safetensors and tokenizers only (never transformers). Tensor names are spelled out here
from the HF conventions, independently of ``llama.py``, so loading a written checkpoint is a real
check of the model's module tree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kvserve.model.config import ModelConfig
from kvserve.model.demo_tokenizer import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    IM_END,
    SPECIAL_TOKENS,
    build_tokenizer,
)

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_LARGEST_DEMO_VOCAB = 1 << 16  # more than the demo corpus can fill


def demo_model_config() -> dict[str, Any]:
    """HF config dict of the built-in demo model: a small GQA Llama sized to the demo tokenizer."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": build_tokenizer(_LARGEST_DEMO_VOCAB).get_vocab_size(),
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }


def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this config holds, by HF name, in a fixed order."""
    hidden, inter, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q_size = config.num_attention_heads * hd
    kv_size = config.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        proj = {"q_proj": (q_size, hidden), "k_proj": (kv_size, hidden),
                "v_proj": (kv_size, hidden), "o_proj": (hidden, q_size)}
        for name, shape in proj.items():
            shapes[f"{p}self_attn.{name}.weight"] = shape
            has_bias = config.o_proj_bias if name == "o_proj" else config.attention_bias
            if has_bias:
                shapes[f"{p}self_attn.{name}.bias"] = (shape[0],)
        if config.qk_norm:
            shapes[f"{p}self_attn.q_norm.weight"] = (hd,)
            shapes[f"{p}self_attn.k_norm.weight"] = (hd,)
        mlp = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden),
               "down_proj": (hidden, inter)}
        for name, shape in mlp.items():
            shapes[f"{p}mlp.{name}.weight"] = shape
            if config.mlp_bias:
                shapes[f"{p}mlp.{name}.bias"] = (shape[0],)
        shapes[f"{p}input_layernorm.weight"] = (hidden,)
        shapes[f"{p}post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def random_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic float32 weights scaled so activations and logits stay O(1) in every layer.

    Norm weights are near (not exactly) one and biases non-zero, so a loader that skipped them
    would be caught by parity tests.
    """
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in hf_tensor_shapes(config).items():
        noise = torch.randn(shape, generator=gen)
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.1 * noise
        elif name.endswith(".bias"):
            weights[name] = 0.2 * noise
        elif name == "model.embed_tokens.weight":
            weights[name] = noise
        else:  # linear [out, in]
            weights[name] = noise / shape[1] ** 0.5
    return weights


def write_random_checkpoint(path: str | Path, config_dict: dict[str, Any], seed: int = 0, *,
                            dtype: torch.dtype = torch.float32, num_shards: int = 1,
                            write_tokenizer: bool = True) -> Path:
    """Write config.json, safetensors weights (sharded with an index when ``num_shards`` > 1),
    generation_config.json and, unless disabled, tokenizer.json + tokenizer_config.json.

    Missing ``bos_token_id``/``eos_token_id`` are filled from the demo tokenizer; the tokenizer
    has at most ``vocab_size`` tokens. Same arguments, same bytes. Returns the directory.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    raw = dict(config_dict)
    specials = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    if write_tokenizer:
        raw.setdefault("bos_token_id", specials[BOS_TOKEN])
        raw.setdefault("eos_token_id", specials[EOS_TOKEN])
    raw.pop("dtype", None)  # transformers >= 5 spelling; one dtype key only
    raw["torch_dtype"] = _DTYPE_NAMES[dtype]
    config = ModelConfig.from_dict(raw, source="config_dict")
    weights = {name: t.to(dtype) for name, t in random_weights(config, seed).items()}
    _write_weights(out, weights, num_shards)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    eos_ids = list(config.eos_token_ids)
    if write_tokenizer and specials[IM_END] not in eos_ids:
        eos_ids.append(specials[IM_END])  # chat turns end with <|im_end|>
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": eos_ids}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n",
                                                encoding="utf-8")
    if write_tokenizer:
        _write_tokenizer(out, config.vocab_size, config.max_position_embeddings)
    return out


def _write_weights(out: Path, weights: dict[str, torch.Tensor], num_shards: int) -> None:
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    metadata = {"format": "pt"}
    if num_shards == 1:
        save_file(weights, str(out / "model.safetensors"), metadata=metadata)
        return
    names = list(weights)
    per_shard = -(-len(names) // num_shards)
    weight_map: dict[str, str] = {}
    for shard in range(num_shards):
        file_name = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        chunk = names[shard * per_shard:(shard + 1) * per_shard]
        save_file({n: weights[n] for n in chunk}, str(out / file_name), metadata=metadata)
        weight_map.update(dict.fromkeys(chunk, file_name))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n",
                                                      encoding="utf-8")


def _write_tokenizer(out: Path, vocab_size: int, max_length: int) -> None:
    tokenizer = build_tokenizer(vocab_size)
    tokenizer.save(str(out / "tokenizer.json"))
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n",
                                               encoding="utf-8")
