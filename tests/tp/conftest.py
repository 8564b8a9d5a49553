"""Tensor-parallel fixtures: tiny random checkpoints that split over two ranks in each way the
sharding must handle (KV heads split; fewer KV heads than ranks, so replicated; q/k/v biases;
tied embeddings; q/k norms; a sliding window)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.model import write_random_checkpoint
from tests.model.arch_configs import ARCH_CONFIGS, base_config

TP_CONFIGS = {
    "llama_gqa": ARCH_CONFIGS["llama_gqa"],  # 6 heads, 2 KV heads: one KV head per rank
    "qwen2_bias_tied": ARCH_CONFIGS["qwen2_bias_tied"],  # q/k/v bias, tied lm_head
    "qwen2_one_kv_head": {**ARCH_CONFIGS["qwen2_bias_tied"],  # 1 KV head < 2 ranks
                          "num_key_value_heads": 1},
    "qwen3_qk_norm": ARCH_CONFIGS["qwen3_qk_norm"],  # 1 KV head, q/k norms
    "mistral_sliding": base_config(architectures=["MistralForCausalLM"], model_type="mistral",
                                   num_attention_heads=4, num_key_value_heads=4,
                                   sliding_window=8),
    # o_proj and down_proj biases: row-parallel, added once (by rank 0).
    "llama_bias": ARCH_CONFIGS["llama_linear_rope_bias"],
    "mistral_three_heads": ARCH_CONFIGS["mistral_sliding"],  # 3 heads: not splittable by 2
}
PARITY_ARCHS = ["llama_gqa", "qwen2_bias_tied", "qwen2_one_kv_head"]


@pytest.fixture(scope="session")
def tp_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-ckpt")
    return {name: write_random_checkpoint(root / name, config, seed=31 + i)
            for i, (name, config) in enumerate(TP_CONFIGS.items())}
