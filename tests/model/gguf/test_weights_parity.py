"""GGUF weights load into kvserve's model exactly as transformers loads the same file: every
tensor equal, logits equal, for every supported storage type and architecture."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from kvserve.model import LlamaForCausalLM, ModelLoadError, load_model, write_random_checkpoint
from kvserve.model.gguf import SUPPORTED_TYPE_NAMES, config_from_gguf, open_gguf
from kvserve.model.gguf.weights import load_gguf_weights

from ..paged_harness import PagedRunner
from .conftest import GGUFFactory
from .gguf_files import tiny_config

transformers = pytest.importorskip("transformers")
SUPPORTED = [T[name] for name in SUPPORTED_TYPE_NAMES]
PROMPT = [5, 17, 99, 3, 250, 41, 8, 77, 120, 64, 33, 200, 11, 150, 9, 310, 45, 2, 180, 96, 71,
          13, 222]  # 23 tokens: spans 6 blocks of 4


def hf_from_gguf(path: Path) -> torch.nn.Module:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # it found every tensor (else it random-inits)
    return model.eval()


def unfused_params(path: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """kvserve's parameters by HF name, straight from the GGUF loader (before fusing)."""
    gguf_file = open_gguf(path)
    config = config_from_gguf(gguf_file)
    network = LlamaForCausalLM(config, dtype=dtype, device="meta")
    network.to_empty(device="cpu")
    network.tie_weights()
    load_gguf_weights(network, gguf_file, config)
    return dict(network.named_parameters())


def assert_logits_match(ours: LlamaForCausalLM, hf: torch.nn.Module) -> None:
    logits = PagedRunner(ours, block_size=4).step([("a", PROMPT)])["a"]  # [23, vocab]
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]  # [23, vocab]
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("qtype", SUPPORTED, ids=SUPPORTED_TYPE_NAMES)
def test_every_supported_type_matches_transformers_tensor_by_tensor_and_in_logits(
        make_gguf: GGUFFactory, qtype: T) -> None:
    path = make_gguf(qtype)
    hf = hf_from_gguf(path)
    expected = hf.state_dict()
    ours = unfused_params(path)
    assert set(ours) == set(expected)
    for name, value in ours.items():
        torch.testing.assert_close(value, expected[name], atol=0, rtol=0, msg=name)
    assert_logits_match(load_model(path).model, hf)


@pytest.mark.parametrize(("arch", "qtype", "overrides"), [
    ("qwen2", T.Q4_0, {}),
    ("qwen2", T.Q6_K, {"tie_word_embeddings": True}),
    ("qwen3", T.Q8_0, {"head_dim": 128}),  # transformers reads no head_dim from a qwen3 GGUF
    ("qwen3", T.Q5_K, {"head_dim": 128, "num_key_value_heads": 1}),
    ("llama", T.Q4_1, {"tie_word_embeddings": True}),
    ("llama", T.F16, {}),
])
def test_architectures_match_transformers(make_gguf: GGUFFactory, arch: str, qtype: T,
                                          overrides: dict[str, object]) -> None:
    path = make_gguf(qtype, arch=arch, **overrides)
    hf = hf_from_gguf(path)
    expected = hf.state_dict()
    for name, value in unfused_params(path).items():
        torch.testing.assert_close(value, expected[name], atol=0, rtol=0, msg=name)
    assert_logits_match(load_model(path).model, hf)


@pytest.mark.parametrize("overrides", [
    {"rope_scaling": {"type": "linear", "factor": 2.0}},
    {"attention_bias": True, "mlp_bias": True},
], ids=["linear_rope", "llama_biases"])
def test_what_transformers_gguf_reader_drops_matches_the_hf_checkpoint(
        make_gguf: GGUFFactory, tmp_path: Path, overrides: dict[str, object]) -> None:
    """transformers ignores a GGUF's rope scaling keys and llama's biases, so the reference is
    the HF checkpoint the F32 file was written from (same random weights)."""
    path = make_gguf(T.F32, **overrides)
    config = config_from_gguf(open_gguf(path))
    hf_dir = write_random_checkpoint(tmp_path / "hf", tiny_config(
        vocab_size=config.vocab_size, **overrides), write_tokenizer=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    expected = hf.state_dict()
    for name, value in unfused_params(path).items():
        torch.testing.assert_close(value, expected[name], atol=0, rtol=0, msg=name)
    assert_logits_match(load_model(path).model, hf)


def test_weights_are_dequantized_to_the_requested_dtype(make_gguf: GGUFFactory) -> None:
    path = make_gguf(T.Q4_K)
    full = unfused_params(path)
    half = unfused_params(path, torch.bfloat16)
    for name, value in half.items():
        assert value.dtype == torch.bfloat16
        torch.testing.assert_close(value, full[name].to(torch.bfloat16), atol=0, rtol=0)
    assert load_model(path, dtype=torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("qtype", [T.TQ2_0, T.TQ1_0])
def test_an_unsupported_type_is_refused_by_name_with_what_to_do(make_gguf: GGUFFactory,
                                                                qtype: T) -> None:
    path = make_gguf(qtype)
    with pytest.raises(ModelLoadError) as exc:
        load_model(path)
    message = str(exc.value)
    assert f"tensor type {qtype.name} is not supported" in message
    assert "blk.0.attn_q.weight" in message and "llama-quantize" in message
    assert all(name in message for name in SUPPORTED_TYPE_NAMES)


def test_a_patched_iq_type_is_refused_before_any_tensor_is_read(make_gguf: GGUFFactory,
                                                                tmp_path: Path) -> None:
    """A file whose q_proj claims IQ4_NL (same block size as Q4_0) is refused by name, even
    with its tensor data cut off: the check reads the tensor table only."""
    source = make_gguf(T.Q4_0)
    opened = open_gguf(source)
    data = bytearray(source.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(name) + len(name)  # then: n_dims (u32), dims (2 x u64), type (u32)
    type_at = at + 4 + 16
    assert int.from_bytes(data[type_at:type_at + 4], "little") == T.Q4_0
    data[type_at:type_at + 4] = int(T.IQ4_NL).to_bytes(4, "little")
    patched = tmp_path / "patched.gguf"
    patched.write_bytes(bytes(data))
    assert open_gguf(patched).tensors["blk.0.attn_q.weight"].ggml_type == T.IQ4_NL
    del opened
    with pytest.raises(ModelLoadError, match=r"IQ4_NL is not supported.*blk.0.attn_q.weight"):
        load_model(patched)
