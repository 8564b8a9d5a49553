"""Tiny HF configs, one per architecture variant the model must reproduce exactly."""

from __future__ import annotations

from typing import Any


def base_config(**overrides: Any) -> dict[str, Any]:
    """A tiny GQA Llama config (odd sizes on purpose); overrides replace or add keys."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 300,
        "hidden_size": 96,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    config.update(overrides)
    return config


# One config per architecture variant the model must reproduce exactly.
ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "llama_gqa": base_config(),
    "llama3_rope": base_config(
        max_position_embeddings=512,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    ),
    "llama_linear_rope_bias": base_config(
        rope_scaling={"type": "linear", "factor": 2.0}, attention_bias=True, mlp_bias=True,
    ),
    "qwen2_bias_tied": base_config(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=64,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        rope_theta=1000000.0, rms_norm_eps=1e-6,
    ),
    "qwen3_qk_norm": base_config(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=80,
        num_attention_heads=4, num_key_value_heads=1, head_dim=24, tie_word_embeddings=True,
    ),
    "mistral_sliding": base_config(
        architectures=["MistralForCausalLM"], model_type="mistral", num_attention_heads=3,
        num_key_value_heads=3, sliding_window=8,
    ),
}
