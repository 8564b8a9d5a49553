"""--dtype bfloat16 and --quantization as the engine applies them at load."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvserve.model import write_random_checkpoint
from kvserve.model.quant_linear import BlockKernelLinear, Int4Linear
from kvserve.model.tensor_parallel import ShardSpec
from kvserve.runtime import EngineArgs, model_setup
from tests.model.arch_configs import base_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = base_config() | {"intermediate_size": 512}  # every input width a multiple of 32
    return write_random_checkpoint(tmp_path_factory.mktemp("modes") / "m", config, seed=5)


def test_quantization_is_checked_at_the_boundary() -> None:
    with pytest.raises(ValueError, match="q4_0, q4_1, q8_0 or w8a8"):
        EngineArgs(quantization="int4")
    with pytest.raises(ValueError, match="on CPU with one rank"):
        EngineArgs(quantization="q4_1", device="cuda")


def test_quantization_serves_every_projection_packed(model_dir: Path) -> None:
    pytest.importorskip("gguf")
    args = EngineArgs(model=str(model_dir), quantization="q4_1")
    loaded, _ = model_setup.load_rank_model(args, ShardSpec(0, 1), "cpu")
    layer = loaded.model.model.layers[0]
    packed = (BlockKernelLinear, Int4Linear)
    assert isinstance(layer.self_attn.packed_qkv, packed)
    assert isinstance(layer.mlp.packed_down, packed)
    assert isinstance(loaded.model.packed_lm_head, packed)
    assert layer.mlp.gate_proj.weight.numel() == 0  # the dense copies are gone


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_w8a8_serves_every_projection_int8_and_the_lm_head_in_the_models_dtype(
        model_dir: Path, dtype: str) -> None:
    from kvserve.model.int8_linear import Int8Linear
    from kvserve.runtime import LLMEngine
    from kvserve.sampling_params import SamplingParams
    args = EngineArgs(model=str(model_dir), dtype=dtype, quantization="w8a8",
                      kv_cache_memory_bytes=1 << 24, max_model_len=256)
    loaded, _ = model_setup.load_rank_model(args, ShardSpec(0, 1), "cpu")
    layer = loaded.model.model.layers[0]
    for op in (layer.self_attn.packed_qkv, layer.self_attn.packed_o, layer.mlp.packed_gate_up,
               layer.mlp.packed_down):
        assert isinstance(op, Int8Linear)
    assert not isinstance(loaded.model.packed_lm_head, Int8Linear)
    assert layer.mlp.gate_proj.weight.numel() == 0  # the dense copies are gone
    # Greedy tokens from the engine, prefill and decode, against the dense model's: the random
    # model's logits are nearly flat, so the first token is compared (it agrees at this seed).
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = []
    for quantization in ("w8a8", None):
        engine = LLMEngine.from_args(EngineArgs(
            model=str(model_dir), dtype=dtype, quantization=quantization,
            kv_cache_memory_bytes=1 << 24, max_model_len=256))
        engine.add_request("r", list(range(3, 40)), params)
        tokens: list[int] = []
        while engine.has_unfinished:
            for out in engine.step():
                tokens = list(out.outputs[0].token_ids)
        assert len(tokens) == 4
        first.append(tokens[0])
    assert first[0] == first[1]


def test_w8a8_refuses_a_gguf_file_with_the_way_out(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    args = EngineArgs(model=str(path), quantization="w8a8")
    with pytest.raises(ValueError, match="quantization='gguf' to keep its blocks"):
        model_setup.load_rank_model(args, ShardSpec(0, 1), "cpu")


def test_bf16_without_bf16_instructions_warns_and_runs_float32(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # Stands in for a CPU without AVX512-BF16/AMX (this one may have them).
    monkeypatch.setattr(model_setup, "has_native_bf16", lambda: False)
    args = EngineArgs(model=str(model_dir), dtype="bfloat16")
    with caplog.at_level(logging.WARNING, logger="kvserve.runtime.model_setup"):
        loaded, _ = model_setup.load_rank_model(args, ShardSpec(0, 1), "cpu")
    assert loaded.dtype == torch.float32
    assert "no bf16 instructions" in caplog.text


def test_bf16_runs_bf16_where_the_cpu_has_it(model_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_setup, "has_native_bf16", lambda: True)
    args = EngineArgs(model=str(model_dir), dtype="bfloat16")
    loaded, _ = model_setup.load_rank_model(args, ShardSpec(0, 1), "cpu")
    assert loaded.dtype == torch.bfloat16


def test_bf16_projections_take_kvserves_kernel_where_it_serves(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve.model.bf16_linear import Bf16Linear, kernel_serves_bf16
    from kvserve.model.onednn_linear import PackedLinear, onednn_available
    if not onednn_available(torch.device("cpu"), torch.bfloat16):
        pytest.skip("this CPU lacks oneDNN's bf16 instructions (and so kvserve's bf16 kernel): "
                    "bf16 projections stay unpacked here")
    monkeypatch.setattr(model_setup, "has_native_bf16", lambda: True)
    args = EngineArgs(model=str(model_dir), dtype="bfloat16")
    loaded, _ = model_setup.load_rank_model(args, ShardSpec(0, 1), "cpu")
    expected = Bf16Linear if kernel_serves_bf16() else PackedLinear
    layer = loaded.model.model.layers[0]
    for op in (layer.self_attn.packed_qkv, layer.self_attn.packed_o, layer.mlp.packed_gate_up,
               layer.mlp.packed_down, loaded.model.packed_lm_head):
        assert isinstance(op, expected)


@pytest.mark.parametrize("env_on, flag, expected", [
    (True, True, True), (False, True, False), (True, False, False)])
def test_the_kernels_run_only_where_the_flag_and_the_environment_allow(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch,
        env_on: bool, flag: bool, expected: bool) -> None:
    # ENV_ENABLED is read once at import: KVSERVE_CPU_KERNELS=0 makes it False.
    from kvserve.model import cpu_kernels
    monkeypatch.setattr(cpu_kernels, "ENV_ENABLED", env_on)
    monkeypatch.setattr(cpu_kernels, "_enabled", True)
    args = EngineArgs(model=str(model_dir), cpu_kernels=flag)
    model_setup.load_rank_model(args, ShardSpec(0, 1), "cpu")
    assert cpu_kernels._enabled is expected
