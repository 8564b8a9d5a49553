"""kvserve's AVX512-BF16 matmul against float64 products of the same bf16 values, and which
packed op a dense weight gets."""

from __future__ import annotations

import pytest
import torch

from kvserve.model import bf16_linear, cpu_kernels
from kvserve.model.bf16_linear import Bf16Linear, kernel_serves_bf16, pack_dense
from kvserve.model.onednn_linear import PackedLinear, cpu_flags

needs_kernel = pytest.mark.skipif(
    not kernel_serves_bf16(),
    reason="kvserve's bf16 matmul serves CPUs with AVX512-BF16 and no AMX (and a C compiler)")


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


# Row counts around the 6-row tile and 48-row block, columns around the 64-column group (and
# a partial last vector), an odd K (padded), SmolLM2's shapes.
SHAPES = [(1, 16, 2), (5, 64, 576), (6, 70, 31), (7, 960, 576), (13, 129, 64),
          (49, 576, 1536), (100, 3072, 576), (1, 1000, 96)]


@needs_kernel
@pytest.mark.parametrize(("rows", "out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_products_of_the_bf16_values(rows, out_features, in_features,
                                                     with_bias):
    gen = torch.Generator().manual_seed(rows * 7 + out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16() if with_bias else None
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    linear = Bf16Linear(weight, bias)
    wide = linear.float_output(x)
    want = reference(x, weight, bias)
    # float32 accumulation over K terms of size ~1: error ~ sqrt(K) * 2^-24 * |terms|
    torch.testing.assert_close(wide.double(), want, atol=2e-5 * in_features ** 0.5, rtol=1e-5)
    got = linear(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    torch.testing.assert_close(got, wide.bfloat16(), atol=0, rtol=0)  # one rounding


@needs_kernel
def test_reads_strided_and_float32_inputs():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(192, 64, generator=gen).bfloat16()
    linear = Bf16Linear(weight, None)
    wide = torch.randn(9, 128, generator=gen).bfloat16()
    x = wide[:, 32:96]  # rows strided wider than K
    torch.testing.assert_close(linear(x), linear(x.contiguous()), atol=0, rtol=0)
    torch.testing.assert_close(linear(x.float()), linear(x.contiguous()), atol=0, rtol=0)
    assert linear(x[:0]).shape == (0, 192)


@needs_kernel
def test_bf16_weights_get_the_kernel_and_float32_ones_onednn():
    weight = torch.randn(64, 32)
    assert isinstance(pack_dense(weight.bfloat16(), None), Bf16Linear)
    assert isinstance(pack_dense(weight, None), PackedLinear)


def test_the_choice_follows_the_cpu(monkeypatch):
    """AMX CPUs keep oneDNN (its AMX tiles are faster), as do builds without the kernel."""
    weight = torch.randn(64, 32).bfloat16()
    monkeypatch.setattr(bf16_linear, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    assert not kernel_serves_bf16()
    with cpu_kernels.disabled():
        monkeypatch.setattr(bf16_linear, "cpu_flags", frozenset)
        assert not kernel_serves_bf16()
        if torch.ops.mkldnn._is_mkldnn_bf16_supported():
            assert isinstance(pack_dense(weight, None), PackedLinear)
    assert ("avx512_bf16" in cpu_flags()) or not kernel_serves_bf16()
