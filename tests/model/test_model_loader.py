"""Loading checkpoints: sharded and tied variants work; every bad checkpoint says what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.model import (
    ModelLoadError,
    demo_model_config,
    load_model,
    resolve_model_path,
    write_random_checkpoint,
)

from .arch_configs import ARCH_CONFIGS, base_config


def state(path: Path) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in load_model(path).model.state_dict().items()}


def test_sharded_checkpoint_loads_the_same_weights(tmp_path: Path) -> None:
    single = write_random_checkpoint(tmp_path / "one", base_config(), seed=3)
    sharded = write_random_checkpoint(tmp_path / "three", base_config(), seed=3, num_shards=3)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    assert not (sharded / "model.safetensors").exists()
    a, b = state(single), state(sharded)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_writer_is_deterministic_and_seeded(tmp_path: Path) -> None:
    first = write_random_checkpoint(tmp_path / "a", base_config(), seed=1)
    again = write_random_checkpoint(tmp_path / "b", base_config(), seed=1)
    other = write_random_checkpoint(tmp_path / "c", base_config(), seed=2)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (first / name).read_bytes() == (again / name).read_bytes(), name
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()


def test_loaded_model_metadata(llama_dir: Path) -> None:
    loaded = load_model(llama_dir)
    assert loaded.path == llama_dir and loaded.device == torch.device("cpu")
    assert loaded.dtype == torch.float32 and not loaded.model.training
    assert loaded.eos_token_ids == (1, 3)  # config's </s>, then generation_config's <|im_end|>
    assert all(not p.requires_grad for p in loaded.model.parameters())


def test_tied_embeddings_share_storage_and_tolerate_a_stored_lm_head(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "tied", ARCH_CONFIGS["qwen2_bias_tied"], seed=0)
    model = load_model(path).model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    weights["model.rotary_emb.inv_freq"] = torch.ones(8)  # legacy buffer, ignored
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    assert torch.equal(load_model(path).model.lm_head.weight, model.lm_head.weight)


def test_bf16_checkpoint_loads_as_float32_on_cpu_unless_asked(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "bf16", base_config(), dtype=torch.bfloat16)
    assert load_model(path).dtype == torch.float32
    loaded = load_model(path, dtype=torch.bfloat16)
    assert loaded.model.lm_head.weight.dtype == torch.bfloat16


def test_demo_model_vocab_matches_its_tokenizer(tmp_path: Path) -> None:
    from kvserve.model import Tokenizer

    path = write_random_checkpoint(tmp_path / "demo", demo_model_config(), seed=0)
    loaded = load_model(path)
    assert Tokenizer.from_pretrained(path).vocab_size == loaded.config.vocab_size
    assert loaded.config.num_key_value_heads < loaded.config.num_attention_heads


def rewrite(path: Path, drop: str | None = None, add: str | None = None) -> None:
    weights = load_file(path / "model.safetensors")
    if drop:
        del weights[drop]
    if add:
        weights[add] = torch.zeros(3)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_and_unexpected_tensors_are_listed(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "m", base_config(), write_tokenizer=False)
    rewrite(path, drop="model.layers.1.mlp.up_proj.weight", add="model.layers.0.extra.weight")
    with pytest.raises(ModelLoadError) as info:
        load_model(path)
    message = str(info.value)
    assert str(path) in message
    assert "missing tensors: model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected tensors: model.layers.0.extra.weight" in message


def test_shape_mismatch_is_named(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "s", base_config(), write_tokenizer=False)
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 128
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"model.layers.0.mlp.up_proj.weight: "
                                             r"checkpoint \[160, 96\], model \[128, 96\]"):
        load_model(path)


def test_unsupported_architecture_and_missing_key(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "a", base_config(), write_tokenizer=False)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["PhiForCausalLM"]}))
    with pytest.raises(ModelLoadError, match=r"PhiForCausalLM.*supports only LlamaForCausalLM"):
        load_model(path)
    del config["num_hidden_layers"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"config.json: key 'num_hidden_layers' is missing"):
        load_model(path)


def test_missing_weights_and_shards(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "w", base_config(), write_tokenizer=False,
                                   num_shards=2)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002.safetensors, which is missing"):
        load_model(path)
    (path / "model.safetensors.index.json").unlink()
    (path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"found pytorch_model.bin; only safetensors"):
        load_model(path)


def test_corrupt_safetensors_file(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "c", base_config(), write_tokenizer=False)
    (path / "model.safetensors").write_bytes(b"\x10\x00garbage")
    with pytest.raises(ModelLoadError, match=r"model.safetensors: not a readable safetensors"):
        load_model(path)


def test_resolve_local_paths(tmp_path: Path, llama_dir: Path) -> None:
    assert resolve_model_path(llama_dir) == llama_dir
    assert resolve_model_path(str(llama_dir)) == llama_dir
    with pytest.raises(ModelLoadError, match=r"no such directory"):
        resolve_model_path(str(tmp_path / "absent"))
    with pytest.raises(ModelLoadError, match=r"no config.json"):
        resolve_model_path(tmp_path)
    with pytest.raises(ModelLoadError, match=r"is a file"):
        resolve_model_path(llama_dir / "config.json")


def test_hub_id_offline_and_not_cached_says_so(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"offline.*not in the local Hugging Face cache"):
        resolve_model_path("kvserve-tests/no-such-model", cache_dir=tmp_path,
                           local_files_only=True)
