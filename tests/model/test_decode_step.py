"""The fused decode step (csrc/decode_step.c) against the per-op path it replaces: the same
kernels in the same order, so logits and every written K/V equal bit for bit, for bf16 models,
for float32 models over packed GGUF blocks, and for int8 projections."""

from __future__ import annotations

import pytest
import torch

from kvserve.model import LlamaForCausalLM, cpu_kernels
from kvserve.model.bf16_linear import kernel_serves_bf16
from kvserve.model.config import ModelConfig
from kvserve.model.decode_step import FusedDecode
from kvserve.model.int8_linear import int8_kernel_serves
from kvserve.model.quant_linear import KERNEL_MAX_TOKENS
from kvserve.model.quantized_model import pack_quantized, quantize_weights

from .arch_configs import ARCH_CONFIGS, base_config
from .paged_harness import PagedRunner

needs_kernel = pytest.mark.skipif(
    not kernel_serves_bf16() or not cpu_kernels.available("decode_step"),
    reason="the fused decode step runs where kvserve's bf16 matmul serves (AVX512-BF16, no AMX)")

needs_block_kernels = pytest.mark.skipif(
    not cpu_kernels.available("decode_step") or not cpu_kernels.available("quant"),
    reason="the fused decode step over GGUF blocks runs on kvserve's AVX-512 or AVX2 kernel set")

# Head dim 32 (rotary needs half a head in 16-lane vectors), GQA 4/2, odd-ish sizes.
SHAPE = {"hidden_size": 128, "intermediate_size": 176, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 3}


def packed_model(seed: int, **overrides: object) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = ModelConfig.from_dict(base_config(**{**SHAPE, **overrides}))
    model = LlamaForCausalLM(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.5 if param.dim() > 1 else 1.0)
    model.fuse_projections()
    model.pack_for_onednn()
    return model.eval()


def block_model(seed: int, ggml_type: str, **overrides: object) -> LlamaForCausalLM:
    """A float32 model whose projections are `ggml_type` blocks (the lm_head Q8_0), packed as
    a GGUF file's are served. Widths are multiples of 32, as the blocks need."""
    torch.manual_seed(seed)
    config = ModelConfig.from_dict(base_config(**{**SHAPE, "intermediate_size": 192,
                                                  **overrides}))
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.5 if param.dim() > 1 else 1.0)
    model.fuse_projections()
    pack_quantized(model, quantize_weights(model, ggml_type))
    return model.eval()


def run_steps(model: LlamaForCausalLM, fused: bool, kv_dtype: torch.dtype | None = None,
              ) -> tuple[list[dict], list[torch.Tensor]]:
    """Two prompts prefilled, then decode steps of 2, 3 and 1 sequences (one joins late)."""
    kept = model.model.fused_decode
    if not fused:
        model.model.fused_decode = None
    try:
        return _steps(PagedRunner(model, num_blocks=32, block_size=4, seed=1, kv_dtype=kv_dtype))
    finally:
        model.model.fused_decode = kept


def _steps(runner: PagedRunner) -> tuple[list[dict], list[torch.Tensor]]:
    outs = [runner.step([("a", list(range(5, 14))), ("b", [7, 8, 9])])]
    for i in range(6):
        outs.append(runner.step([("a", [20 + i]), ("b", [40 + i])]))
    outs.append(runner.step([("c", [1, 2, 3, 4, 5, 6])]))
    for i in range(5):
        outs.append(runner.step([("b", [60 + i]), ("c", [80 + i]), ("a", [90 + i])]))
    runner.free("a")
    runner.free("b")
    for i in range(3):
        outs.append(runner.step([("c", [100 + i])]))
    caches = [t for c in runner.caches for t in (c.key_cache, c.value_cache)]
    return outs, caches


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each FusedDecode call ran the step (True) or declined it (False)."""
    calls: list[bool] = []
    original = FusedDecode.__call__

    def counting(self, *args):
        out = original(self, *args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(FusedDecode, "__call__", counting)
    return calls


def assert_same(got: tuple[list[dict], list[torch.Tensor]],
                want: tuple[list[dict], list[torch.Tensor]]) -> None:
    for step_got, step_want in zip(got[0], want[0], strict=True):
        for seq, logits in step_want.items():
            torch.testing.assert_close(step_got[seq], logits, atol=0, rtol=0)
    for a, b in zip(got[1], want[1], strict=True):
        assert torch.equal(a, b)


@needs_kernel
@pytest.mark.parametrize("arch", ["plain", "biases"])
def test_equals_the_per_op_path_bit_for_bit(arch, fused_calls):
    overrides = {"attention_bias": True, "mlp_bias": True} if arch == "biases" else {}
    model = packed_model(3, **overrides)
    assert model.model.fused_decode is not None
    got = run_steps(model, fused=True)
    # Steps of decodes only ran fused; the two with a prefill did not.
    assert fused_calls.count(True) == 14 and fused_calls.count(False) == 2, fused_calls
    assert_same(got, run_steps(model, fused=False))


@needs_kernel
def test_not_built_for_what_its_kernels_do_not_run():
    for arch in ("mistral_sliding", "qwen3_qk_norm"):
        variant = {k: v for k, v in ARCH_CONFIGS[arch].items() if k not in SHAPE}
        assert FusedDecode.build(packed_model(0, **variant).model) is None, arch
    torch.manual_seed(0)
    fp32 = LlamaForCausalLM(ModelConfig.from_dict(base_config(**SHAPE)))
    fp32.fuse_projections()
    fp32.pack_for_onednn()
    assert fp32.model.fused_decode is None


@needs_kernel
def test_steps_with_tensor_parallel_ranks_take_the_per_op_path(fused_calls):
    model = packed_model(5)
    model.set_all_reduce(lambda t: t)  # a one-rank group: set after building, seen per step
    got = run_steps(model, fused=True)
    assert fused_calls and not any(fused_calls)
    assert_same(got, run_steps(model, fused=False))


@needs_block_kernels
def test_a_model_given_lora_deltas_or_an_all_reduce_after_building_takes_the_per_op_path(
        fused_calls):
    """Both are set on the layers after the fused step is built; each step sees them."""
    model = block_model(7, "Q4_1")
    layer = model.model.layers[2]
    layer.mlp.lora = object()  # only checked against None before any use
    assert model.model.fused_decode is not None and not model.model.fused_decode._plain()
    layer.mlp.lora = None
    model.set_all_reduce(lambda t: t)  # a one-rank group
    got = run_steps(model, fused=True)
    assert fused_calls and not any(fused_calls)
    model.set_all_reduce(None)
    assert_same(got, run_steps(model, fused=False))


@needs_block_kernels
@pytest.mark.parametrize(("ggml_type", "arch"), [("Q4_1", "plain"), ("Q8_0", "biases")])
def test_packed_blocks_equal_the_per_op_path_bit_for_bit(ggml_type, arch, fused_calls):
    overrides = {"attention_bias": True, "mlp_bias": True} if arch == "biases" else {}
    model = block_model(4, ggml_type, **overrides)
    assert model.model.fused_decode is not None
    got = run_steps(model, fused=True)
    assert fused_calls.count(True) == 14 and fused_calls.count(False) == 2, fused_calls
    assert_same(got, run_steps(model, fused=False))


@needs_block_kernels
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_packed_blocks_over_a_16_bit_cache_equal_the_per_op_path_bit_for_bit(kv_dtype,
                                                                             fused_calls):
    """float32 activations, bf16 or fp16 K/V (`--kv-cache-dtype`): the step rounds each new
    K/V row as torch's `.to()` does, and attention reads the same rounded cache."""
    model = block_model(6, "Q4_1")
    got = run_steps(model, fused=True, kv_dtype=kv_dtype)
    assert fused_calls.count(True) == 14 and fused_calls.count(False) == 2, fused_calls
    assert all(t.dtype == kv_dtype for t in got[1])
    assert_same(got, run_steps(model, fused=False, kv_dtype=kv_dtype))


@needs_block_kernels
def test_packed_blocks_decline_what_the_block_kernels_do_not_take(fused_calls):
    # A projection left float32 (an input width that is no multiple of 32) is not a block
    # kernel's: the model is not fused.
    assert block_model(0, "Q4_1", intermediate_size=176).model.fused_decode is None
    # More decodes in a step than the block kernels take a call: the per-op path decodes the
    # weights whole, and so does the step.
    model = block_model(1, "Q8_0")
    runner = PagedRunner(model, num_blocks=4 * (KERNEL_MAX_TOKENS + 1), block_size=4, seed=1)
    seqs = [(f"s{i}", [3 + i % 50]) for i in range(KERNEL_MAX_TOKENS + 1)]
    runner.step(seqs)  # a prefill of one token each
    runner.step([(name, [9]) for name, _ in seqs])
    assert fused_calls == [False, False]


needs_int8_kernel = pytest.mark.skipif(
    not int8_kernel_serves() or not cpu_kernels.available("decode_step"),
    reason="the fused decode step over int8 projections runs where kvserve's int8 kernel "
           "serves (AVX512-VNNI)")


@needs_int8_kernel
@pytest.mark.parametrize(("dtype", "arch"), [(torch.bfloat16, "biases"),
                                             (torch.float32, "plain")])
def test_int8_projections_equal_the_per_op_path_bit_for_bit(dtype, arch, fused_calls):
    torch.manual_seed(5)
    overrides = {"attention_bias": True, "mlp_bias": True} if arch == "biases" else {}
    config = ModelConfig.from_dict(base_config(**{**SHAPE, "intermediate_size": 192,
                                                  **overrides}))
    model = LlamaForCausalLM(config, dtype=dtype)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.5 if param.dim() > 1 else 1.0)
    model.fuse_projections()
    model.pack_int8()
    assert model.model.fused_decode is not None
    got = run_steps(model.eval(), fused=True)
    assert fused_calls.count(True) == 14 and fused_calls.count(False) == 2, fused_calls
    assert_same(got, run_steps(model, fused=False))
