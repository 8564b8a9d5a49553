"""ModelConfig: HF config.json variants parse to the right switches; bad ones say what to fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve.model import ModelConfig, ModelLoadError, RopeScaling

from .arch_configs import ARCH_CONFIGS, base_config


def parse(**overrides: Any) -> ModelConfig:
    return ModelConfig.from_dict(base_config(**overrides))


def test_llama_defaults_and_derived_fields() -> None:
    config = parse(eos_token_id=[2, 7], bos_token_id=1, torch_dtype="bfloat16")
    assert config.architecture == "LlamaForCausalLM"
    assert config.head_dim == 16 and config.num_queries_per_kv == 3
    assert config.rope_scaling is None and config.rope_theta == 10000.0
    assert config.sliding_windows == (None, None)
    assert config.eos_token_ids == (2, 7) and config.bos_token_id == 1
    assert config.dtype == torch.bfloat16
    assert not (config.attention_bias or config.o_proj_bias or config.mlp_bias or config.qk_norm)
    raw = base_config()
    del raw["num_key_value_heads"], raw["rope_theta"], raw["rms_norm_eps"]
    defaults = ModelConfig.from_dict(raw)
    assert defaults.num_key_value_heads == 6 and defaults.rope_theta == 10000.0
    assert defaults.rms_norm_eps == 1e-6 and defaults.dtype == torch.float32


def test_architecture_switches() -> None:
    qwen2 = ModelConfig.from_dict(ARCH_CONFIGS["qwen2_bias_tied"])
    assert qwen2.attention_bias and not qwen2.o_proj_bias and qwen2.tie_word_embeddings
    qwen3 = ModelConfig.from_dict(ARCH_CONFIGS["qwen3_qk_norm"])
    assert qwen3.qk_norm and qwen3.head_dim == 24 and not qwen3.attention_bias
    raw = dict(ARCH_CONFIGS["qwen3_qk_norm"])
    del raw["head_dim"]
    assert ModelConfig.from_dict(raw).head_dim == 128  # HF's Qwen3 default, not hidden // heads
    llama = ModelConfig.from_dict(ARCH_CONFIGS["llama_linear_rope_bias"])
    assert llama.attention_bias and llama.o_proj_bias and llama.mlp_bias
    assert llama.rope_scaling == RopeScaling("linear", 2.0)


def test_rope_scaling_legacy_and_transformers5_forms_agree() -> None:
    legacy = parse(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    raw = base_config(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    del raw["rope_theta"]
    modern = ModelConfig.from_dict(raw)
    assert legacy == modern
    assert modern.rope_theta == 500000.0 and modern.rope_scaling is not None
    assert modern.rope_scaling.rope_type == "llama3"
    assert parse(rope_parameters={"rope_type": "default", "rope_theta": 5.0}).rope_scaling is None


def test_sliding_windows_follow_hf_rules() -> None:
    mistral = ModelConfig.from_dict(ARCH_CONFIGS["mistral_sliding"])
    assert mistral.sliding_windows == (8, 8)
    assert ModelConfig.from_dict({**ARCH_CONFIGS["mistral_sliding"],
                                  "sliding_window": None}).sliding_windows == (None, None)
    no_key = dict(ARCH_CONFIGS["mistral_sliding"])
    del no_key["sliding_window"]
    assert ModelConfig.from_dict(no_key).sliding_windows == (4096, 4096)
    qwen = {**ARCH_CONFIGS["qwen2_bias_tied"], "sliding_window": 16, "num_hidden_layers": 3}
    assert ModelConfig.from_dict(qwen).sliding_windows == (None,) * 3  # use_sliding_window off
    on = {**qwen, "use_sliding_window": True, "max_window_layers": 1}
    assert ModelConfig.from_dict(on).sliding_windows == (None, 16, 16)
    typed = {**on, "layer_types": ["sliding_attention", "full_attention", "full_attention"]}
    assert ModelConfig.from_dict(typed).sliding_windows == (16, None, None)


@pytest.mark.parametrize(("overrides", "key", "hint"), [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures", "Qwen3ForCausalLM"),
    ({"hidden_size": True}, "hidden_size", "positive integer"),
    ({"num_key_value_heads": 4}, "num_key_value_heads", "must divide"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling", "llama3"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling", "low_freq_factor"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor", "1.0"),
    ({"hidden_act": "gelu"}, "hidden_act", "silu"),
    ({"torch_dtype": "float8"}, "torch_dtype", "bfloat16"),
    ({"head_dim": 15}, "head_dim", "even"),
])
def test_unsupported_values_name_the_key_and_the_fix(overrides: dict[str, Any], key: str,
                                                     hint: str) -> None:
    with pytest.raises(ModelLoadError, match=f"'{key}'") as info:
        ModelConfig.from_dict(base_config(**overrides), source="/m/config.json")
    assert "/m/config.json" in str(info.value) and hint in str(info.value)


def test_missing_key_names_file_and_key(tmp_path: Path) -> None:
    raw = base_config()
    del raw["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="intermediate_size' is missing") as info:
        ModelConfig.from_file(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)
    assert "LlamaForCausalLM" in str(info.value)


def test_unreadable_config_files(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="file not found"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="JSON"):
        ModelConfig.from_file(tmp_path)
