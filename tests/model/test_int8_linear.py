"""int8 x int8 linear layers (model/int8_linear.py): kvserve's VNNI kernel and the portable path
against exact integer products of the same codes, and the rounding both share."""

from __future__ import annotations

import pytest
import torch

from kvserve.model import int8_linear
from kvserve.model.int8_linear import (
    ACT_BLOCK,
    Int8Linear,
    int8_kernel_serves,
    quantize_activations,
)

needs_kernel = pytest.mark.skipif(
    not int8_kernel_serves(),
    reason="kvserve's int8 matmul serves x86-64 CPUs with AVX512-VNNI (and a C compiler)")


def exact(x: torch.Tensor, linear: Int8Linear) -> torch.Tensor:
    """Each block's integer dot product in float64 (exact), scaled as the contract says."""
    codes, scales = quantize_activations(x)  # [T, B, 32], [T, B, 1]
    w = linear.weight_codes().double().view(linear.out_features, -1, ACT_BLOCK)  # [N, B, 32]
    blocks = torch.einsum("tbk,nbk->tnb", codes.double(), w)  # exact: |sum| < 2^24
    out = (blocks * scales.double().squeeze(-1)[:, None, :]).sum(-1)
    out = out * linear.scales[:linear.out_features].double()
    return out if linear.bias is None else out + linear.bias.double()


# Rows around the 6-row tile and 48-row block, columns around the 32-column group (a partial
# last vector), SmolLM2's shapes.
SHAPES = [(1, 16, 32), (5, 64, 576), (6, 70, 96), (7, 960, 576), (13, 33, 64),
          (49, 576, 1536), (100, 1728, 576)]


@needs_kernel
@pytest.mark.parametrize(("rows", "out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_sums_exact_block_products(rows, out_features, in_features, dtype):
    gen = torch.Generator().manual_seed(rows * 7 + out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    linear = Int8Linear(weight, bias)
    assert linear.packed is not None
    got = linear(x)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    want = exact(x, linear)
    # float32 sums of K/32 scaled blocks, then (bf16) one rounding.
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -8
    err = ((got.double() - want).abs() / want.abs().amax()).max().item()
    assert err < tolerance, err


def test_the_portable_path_sums_the_same_products(monkeypatch):
    monkeypatch.setattr(int8_linear, "int8_kernel_serves", lambda: False)
    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(70, 96, generator=gen), torch.randn(9, 96, generator=gen)
    linear = Int8Linear(weight, None)
    assert linear.packed is None
    got = linear(x)
    want = exact(x, linear)
    assert ((got.double() - want).abs() / want.abs().amax()).max().item() < 1e-5


@needs_kernel
def test_kernel_and_portable_paths_keep_the_same_codes():
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(40, 64, generator=gen)
    kernel = Int8Linear(weight, None)
    codes = torch.round(weight / (weight.abs().amax(1, keepdim=True) / 127)).to(torch.int8)
    assert torch.equal(kernel.weight_codes(), codes)


def test_an_outlier_coarsens_only_its_own_block():
    x = torch.linspace(-1, 1, 3 * ACT_BLOCK).reshape(1, -1)
    x[0, ACT_BLOCK + 3] = 1000.0
    codes, scales = quantize_activations(x)
    assert scales[0, 0, 0] == pytest.approx(1 / 127) and scales[0, 2, 0] == pytest.approx(1 / 127)
    assert scales[0, 1, 0] == pytest.approx(1000 / 127)
    assert codes.abs().max() == 127
    assert torch.allclose(codes[0, 0] * scales[0, 0], x[0, :ACT_BLOCK], atol=0.5 / 127)


def test_a_zero_row_gives_the_bias():
    linear = Int8Linear(torch.randn(8, 32), torch.arange(8.0))
    assert torch.equal(linear(torch.zeros(2, 32)), torch.arange(8.0).expand(2, 8))


def test_inputs_not_in_blocks_of_32_are_refused_with_the_way_out():
    with pytest.raises(ValueError, match=r"divisible by 32.*without w8a8"):
        Int8Linear(torch.randn(8, 48), None)
