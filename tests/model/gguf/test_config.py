"""ModelConfig from GGUF metadata equals the config of the HF checkpoint the file stands for."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from kvserve.model import ModelConfig, ModelLoadError
from kvserve.model.gguf import config_from_gguf, open_gguf

from .conftest import GGUFFactory
from .gguf_files import Vocabulary, tiny_config, write_gguf


def expected(arch: str, vocab: Vocabulary, **overrides: Any) -> ModelConfig:
    """The HF config the fixture was written from, with the ids the file's tokenizer names
    (GGUF stores the norm epsilon as float32, as transformers then reads it)."""
    config = ModelConfig.from_dict(tiny_config(arch, vocab_size=len(vocab.tokens), **overrides))
    return replace(config, bos_token_id=vocab.tokens.index("<|endoftext|>"),
                   eos_token_ids=(vocab.tokens.index("<|im_end|>"),),
                   rms_norm_eps=float(np.float32(config.rms_norm_eps)))


@pytest.mark.parametrize(("arch", "overrides"), [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "rope_scaling": {"type": "linear", "factor": 2.0}}),
    ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("qwen2", {}),
    ("qwen3", {"head_dim": 128, "num_key_value_heads": 1}),
])
def test_config_from_metadata_equals_the_hf_config(make_gguf: GGUFFactory, gpt2_vocab: Vocabulary,
                                                   arch: str, overrides: dict[str, Any]) -> None:
    path = make_gguf(T.Q8_0, arch=arch, **overrides)
    assert config_from_gguf(open_gguf(path)) == expected(arch, gpt2_vocab, **overrides)


def test_eot_is_an_extra_eos_id(tmp_path: Path, gpt2_vocab: Vocabulary) -> None:
    eot = gpt2_vocab.tokens.index("<|endoftext|>")
    path = write_gguf(tmp_path / "m.gguf", tiny_config(vocab_size=len(gpt2_vocab.tokens)),
                      gpt2_vocab, extra={"tokenizer.ggml.eot_token_id":
                                         (eot, gguf.GGUFValueType.UINT32)})
    config = config_from_gguf(open_gguf(path))
    assert config.eos_token_ids == (gpt2_vocab.tokens.index("<|im_end|>"), eot)


def test_unknown_architecture_is_named_with_the_supported_ones(tmp_path: Path,
                                                               gpt2_vocab: Vocabulary) -> None:
    path = write_gguf(tmp_path / "m.gguf", tiny_config(vocab_size=len(gpt2_vocab.tokens)),
                      gpt2_vocab)
    data = bytearray(path.read_bytes())
    at = data.index(b"llama")  # general.architecture's value comes first
    data[at:at + 5] = b"gemma"
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"'gemma' is not supported.*llama, mistral, qwen2"):
        config_from_gguf(open_gguf(path))


def test_missing_key_and_unstated_rope_factors_are_named(tmp_path: Path,
                                                         gpt2_vocab: Vocabulary) -> None:
    config = tiny_config(vocab_size=len(gpt2_vocab.tokens))
    path = write_gguf(tmp_path / "m.gguf", config, gpt2_vocab)
    meta = open_gguf(path)
    del meta.metadata["llama.block_count"]
    with pytest.raises(ModelLoadError, match=r"'llama.block_count' is missing"):
        config_from_gguf(meta)
    opened = open_gguf(path)
    opened.tensors["rope_freqs.weight"] = opened.tensors["output_norm.weight"]
    with pytest.raises(ModelLoadError, match=r"rope_freqs.weight.*--hf-config-path"):
        config_from_gguf(opened)


def test_not_a_gguf_file_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04 not gguf")
    with pytest.raises(ModelLoadError, match=r"not a GGUF file"):
        open_gguf(bad)
    with pytest.raises(ModelLoadError, match=r"no such GGUF file"):
        open_gguf(tmp_path / "absent.gguf")
