"""Weights kept in GGUF's blocks: kvserve's decoding equals gguf's, every kernel path computes
what a dense matmul by the dequantized weight does, and a packed model keeps its logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvserve.model import AttentionMetadata, allocate_kv_caches, cpu_kernels, load_model
from kvserve.model.ggml_blocks import (
    QuantizedWeight,
    concat_rows,
    dequantize,
    int4_codes,
    quantize,
)
from kvserve.model.quant_linear import (
    KERNEL_MAX_TOKENS,
    BlockKernelLinear,
    DequantizedLinear,
    Int4Linear,
    int4_op_available,
    kernels_take_many_rows,
    make_quantized_linear,
)
from kvserve.model.quantized_model import pack_quantized, quantize_weights

gguf = pytest.importorskip("gguf")
TYPES = ("Q4_0", "Q4_1", "Q8_0")


def _weight(ggml_type: str, out: int = 96, inp: int = 128, seed: int = 0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(out, inp, generator=gen) * 0.1, ggml_type)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_kvserves_decoding_equals_the_gguf_packages(ggml_type: str) -> None:
    weight = _weight(ggml_type)
    reference = gguf.quants.dequantize(weight.data.numpy(),
                                       gguf.GGMLQuantizationType[ggml_type])
    assert torch.equal(dequantize(weight), torch.from_numpy(np.ascontiguousarray(reference)))


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1"])
def test_4bit_types_fit_torchs_int4_form_exactly(ggml_type: str) -> None:
    # torch's op computes (q - 8) * scale + zero per group of 32: Q4_1's d*q + m is scale d,
    # zero m + 8d; Q4_0's d*(q - 8) is scale d, zero 0.
    weight = _weight(ggml_type)
    codes, scale, zero = int4_codes(weight)
    assert codes.min() >= 0 and codes.max() <= 15
    form = (codes.float() - 8).view(96, 4, 32) * scale.unsqueeze(-1) + zero.unsqueeze(-1)
    assert torch.equal(form.view(96, 128), dequantize(weight))
    if ggml_type == "Q4_0":
        assert not zero.any()


def _paths() -> list[str]:
    return ["c_kernel", "torch_int4", "portable"]


def _int16_kernel_reference(layer: BlockKernelLinear, x: torch.Tensor) -> torch.Tensor:
    """What the C kernels compute, in float64: each token's activations rounded to int16 per
    block of 32 (scale max|x| / 32767, ties to even), times the weight's codes and scales,
    plus Q4's per-block min times the exact float activation sum."""
    blocks = x.view(x.shape[0], -1, 32)  # [T, in/32, 32]
    amax = blocks.abs().amax(-1, keepdim=True)
    # 32767 / amax as one float32 division, as in C (torch's scalar / tensor is a reciprocal
    # times the scalar, which rounds differently)
    inv = torch.where(amax > 0, torch.full_like(amax, 32767.0) / amax, torch.zeros_like(amax))
    x_hat = (torch.round(blocks * inv).double() * (amax / 32767.0).double()).view_as(x)
    weight = layer.dequantized().double()
    if layer.is_q8:
        return x_hat @ weight.t()
    mins = layer.min.double().repeat_interleave(32, dim=1)  # [out, in]
    return x_hat @ (weight - mins).t() + x.double() @ mins.t()


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("path", _paths())
def test_every_path_computes_the_dequantized_matmul(ggml_type: str, path: str) -> None:
    weight = _weight(ggml_type)
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(96, generator=gen)
    dense = dequantize(weight).double()
    if path == "c_kernel" and not cpu_kernels.available("quant"):
        pytest.skip("kvserve's CPU kernels need x86-64 with AVX2 or AVX-512 and a C compiler")
    kernel = {"c_kernel": "auto", "torch_int4": "torch_int4", "portable": "portable"}[path]
    layer = make_quantized_linear(weight, bias, kernel=kernel)
    expected_type = {"c_kernel": BlockKernelLinear, "torch_int4": Int4Linear,
                     "portable": DequantizedLinear}[path]
    assert isinstance(layer, expected_type)
    # torch's int4 path rounds activations and scales to bf16, the C kernels activations to
    # int16 per block (|error| <= max|x| / 65534 an activation); the portable one is float32.
    tol = {"torch_int4": 3e-2, "c_kernel": 1e-3, "portable": 1e-5}[path]
    # one token, a tile of 4 and a remainder (3 = none whole, 13 = three tiles and one), and
    # more than the kernels take (the weight decoded whole)
    for tokens in (1, 3, 13, KERNEL_MAX_TOKENS + 8):
        x = torch.randn(tokens, 128, generator=gen)
        want = x.double() @ dense.t() + bias.double()
        got = layer(x)
        assert got.shape == (tokens, 96) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
        if path == "c_kernel" and (tokens <= KERNEL_MAX_TOKENS or kernels_take_many_rows()):
            # its int16 numerics, exactly
            assert isinstance(layer, BlockKernelLinear)
            exact = _int16_kernel_reference(layer, x) + bias.double()
            torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
        assert layer(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("in_features", [32, 64, 96, 160, 576])
def test_one_token_takes_every_block_whatever_their_count(ggml_type: str,
                                                          in_features: int) -> None:
    """One token runs the 4-bit kernels' pairwise path (two blocks a step, two pairs a loop,
    an odd last block alone): 1 to 18 blocks cover each of those tails. A block left out or
    read with another block's scale fails the exact comparison."""
    if not cpu_kernels.available("quant"):
        pytest.skip("kvserve's CPU kernels need x86-64 with AVX2 or AVX-512 and a C compiler")
    layer = make_quantized_linear(_weight(ggml_type, 72, in_features, seed=3), None)
    assert isinstance(layer, BlockKernelLinear)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        x = torch.randn(1, in_features, generator=gen) * torch.rand(in_features, generator=gen)
        torch.testing.assert_close(layer(x).double(), _int16_kernel_reference(layer, x),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("in_features", [32, 576])
def test_many_rows_keep_the_int16_numerics(ggml_type: str, in_features: int) -> None:
    """From QGEMM_MIN_TOKENS (16) rows the many-row kernel widens each group of columns (32 in
    csrc/quant_gemm.c, 16 in csrc/avx2/quant_gemm.c) once and runs every row against it: the
    last row count below it, row counts ending in partial tiles (6 rows with AVX512-VNNI, 3
    with AVX2), a prefill past KERNEL_MAX_TOKENS, one past two of the AVX2 kernel's 192-row
    chunks (the whole weight widened first), one block or 18, and a last group of 8 columns
    (72)."""
    if not kernels_take_many_rows():
        pytest.skip("the many-row block kernels are built for AVX512-VNNI and AVX2 CPUs")
    layer = make_quantized_linear(_weight(ggml_type, 72, in_features, seed=5), None)
    assert isinstance(layer, BlockKernelLinear)
    gen = torch.Generator().manual_seed(6)
    for tokens in (15, 16, 17, 23, KERNEL_MAX_TOKENS + 35, 2 * 192 + 5):
        x = (torch.randn(tokens, in_features, generator=gen)
             * torch.rand(in_features, generator=gen))
        torch.testing.assert_close(layer(x).double(), _int16_kernel_reference(layer, x),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_the_kernels_decode_the_weight_as_torch_does(ggml_type: str) -> None:
    """Prefill (more rows than KERNEL_MAX_TOKENS) multiplies by the weight the kernels decode."""
    lib = cpu_kernels.library("quant")
    if lib is None:
        pytest.skip("kvserve's CPU kernels need x86-64 with AVX2 or AVX-512 and a C compiler")
    weight = _weight(ggml_type, out=80, inp=160)  # 80 rows: threaded
    layer = BlockKernelLinear(weight, None)
    torch.testing.assert_close(layer.decoded_by_kernel(lib), dequantize(weight),
                               rtol=1e-6, atol=1e-7)


def test_auto_without_kvserves_kernels_takes_torchs_int4_op() -> None:
    with cpu_kernels.disabled():
        assert isinstance(make_quantized_linear(_weight("Q4_1")), Int4Linear)
    # Types the packed paths do not read run dequantized.
    q5 = _weight("Q5_0", out=8)
    layer = make_quantized_linear(q5)
    assert isinstance(layer, DequantizedLinear)
    x = torch.randn(2, 128)
    torch.testing.assert_close(layer(x), x @ dequantize(q5).t(), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not int4_op_available(), reason="this PyTorch has no int4 CPU op")
@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_1"])
def test_rows_torchs_int4_op_packs_in_sixteens_are_padded_and_stay_packed(ggml_type: str) -> None:
    # torch packs output rows in groups of 16; a tiny model's 40-row weight (or a vocabulary
    # like 1000 + 8) runs packed all the same, its padding rows never in the output.
    odd = _weight(ggml_type, out=40)
    layer = make_quantized_linear(odd, kernel="torch_int4")
    assert isinstance(layer, Int4Linear)
    x = torch.randn(3, 128)
    out = layer(x)
    assert out.shape == (3, 40)
    # bf16 activations and scales: the op's own rounding, as for the whole-group weights above.
    torch.testing.assert_close(out, x @ dequantize(odd).t(), rtol=3e-2, atol=3e-2)


def test_bad_blocks_are_refused_with_the_fix() -> None:
    good = _weight("Q4_1")
    with pytest.raises(ValueError, match="take 80 bytes"):
        QuantizedWeight("Q4_1", (96, 128), good.data[:, :60])
    with pytest.raises(ValueError, match="uint8"):
        QuantizedWeight("Q4_1", (96, 128), good.data.int())
    with pytest.raises(ValueError, match="one ggml type"):
        concat_rows([good, _weight("Q8_0")])
    with pytest.raises(ValueError, match="kernel must be"):
        make_quantized_linear(good, kernel="fast")


def _logits(model: torch.nn.Module, config: object, ids: torch.Tensor) -> torch.Tensor:
    meta = AttentionMetadata.from_lists([len(ids)], [len(ids)], [[0, 1, 2]], 16)
    kv = allocate_kv_caches(config, 3, 16, dtype=torch.float32, device="cpu")  # type: ignore[arg-type]
    hidden = model(ids, torch.arange(len(ids)), kv, meta)
    return model.compute_logits(hidden)  # [T, vocab]


@pytest.mark.parametrize("arch", ["llama_gqa", "qwen2_bias_tied"])
@pytest.mark.parametrize("kernel", ["auto", "portable"])
def test_a_packed_model_gives_the_dequantized_models_logits(
        arch: str, kernel: str, arch_checkpoints: dict[str, Path]) -> None:
    path = arch_checkpoints[arch]
    packed, reference = load_model(path), load_model(path)
    weights = quantize_weights(packed.model, "Q4_1")
    pack_quantized(packed.model, weights, kernel=kernel)
    # The reference: the same blocks dequantized into the dense model's parameters; a tied
    # lm_head is untied there, since the packed model keeps its embeddings dense.
    head = weights.pop("lm_head.weight")
    reference.model.lm_head.weight = torch.nn.Parameter(dequantize(head), requires_grad=False)
    params = dict(reference.model.named_parameters())
    with torch.no_grad():
        for name, weight in weights.items():
            params[name].copy_(dequantize(weight))
    config = packed.model.config
    ids = torch.randint(4, config.vocab_size, (21,), generator=torch.Generator().manual_seed(3))
    got, want = _logits(packed.model, config, ids), _logits(reference.model, config, ids)
    # "auto" is kvserve's kernels (activations rounded to int16 a block) or, on a CPU without
    # them, torch's int4 op (activations rounded to bf16); "portable" stays float32.
    if kernel == "portable":
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    elif cpu_kernels.available("quant"):
        error, spread = (got - want).abs(), (want.max() - want.min()).item()
        assert error.max().item() < 5e-4 * spread and error.mean().item() < 1e-4 * spread
    else:
        torch.testing.assert_close(got, want, rtol=5e-2, atol=0.25)
    layer = packed.model.model.layers[0]
    assert layer.self_attn.q_proj.weight.numel() == layer.mlp.down_proj.weight.numel() == 0


def test_packing_names_a_missing_weight(llama_dir: Path) -> None:
    loaded = load_model(llama_dir)
    weights = quantize_weights(loaded.model, "Q8_0")
    del weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj.weight"):
        pack_quantized(loaded.model, weights)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_packed_scales_are_the_blocks_own_fp16_bytes(ggml_type: str) -> None:
    """One token's matmul is bound by the bytes it reads: the kernels read GGUF's fp16 scales
    (and Q4_1's fp16 mins) as the file holds them, not float32 copies."""
    weight = _weight(ggml_type)
    layer = BlockKernelLinear(weight, None)
    raw = weight.data.reshape(96, 4, -1)  # [out, blocks, block bytes]
    assert layer.scale.dtype == torch.float16
    assert torch.equal(layer.scale.view(torch.uint8).view(96, 4, 2), raw[..., 0:2])
    if ggml_type == "Q4_1":
        assert torch.equal(layer.min.view(torch.uint8).view(96, 4, 2), raw[..., 2:4])
    if ggml_type == "Q4_0":
        assert torch.equal(layer.min.float(), -8 * layer.scale.float())
    torch.testing.assert_close(layer.dequantized(), dequantize(weight), rtol=1e-6, atol=1e-7)


def test_a_q4_0_scale_whose_min_overflows_fp16_is_refused() -> None:
    weight = _weight("Q4_0")
    raw = weight.data.reshape(96, 4, 18).clone()
    raw[0, 0, 0:2] = torch.tensor([9000.0], dtype=torch.float16).view(torch.uint8)
    huge = QuantizedWeight("Q4_0", weight.shape, raw.reshape(96, -1))
    with pytest.raises(ValueError, match="without --quantization"):
        BlockKernelLinear(huge, None)
