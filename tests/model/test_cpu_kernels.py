"""kvserve's CPU kernels: the build, and the fused position-wise ops against PyTorch's."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from kvserve.model import cpu_kernels, cpu_pointwise
from kvserve.model.layers import RMSNorm
from kvserve.model.rotary import apply_rotary

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(),
    reason="kvserve's CPU kernels are not available here (needs x86-64 with AVX-512 and a C "
           "compiler)")


def test_one_build_is_shared_by_later_loads(tmp_path, monkeypatch):
    """The library is built once into the cache dir, keyed by its sources; a second build
    call finds it instead of compiling again, and no temporary file is left."""
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    compiler = cpu_kernels.find_compiler()
    assert compiler is not None
    first = cpu_kernels.build(compiler)
    assert first.parent == tmp_path / "kernels" and first.exists()
    mtime = first.stat().st_mtime_ns
    assert cpu_kernels.build(compiler) == first
    assert first.stat().st_mtime_ns == mtime
    assert [p.name for p in first.parent.iterdir()] == [first.name]


def test_a_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    with pytest.raises(OSError):
        cpu_kernels.build(str(tmp_path / "no-such-compiler"))
    assert not (tmp_path / "kernels").exists() or not any((tmp_path / "kernels").iterdir())


def reference_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = RMSNorm(x.shape[-1], eps)
    norm.weight.data = weight
    with cpu_kernels.disabled():
        return norm(x)


@pytest.mark.parametrize("dim", [16, 48, 256, 768])
@pytest.mark.parametrize("tokens", [1, 7, 130])
def test_rms_norm_matches_pytorch(dim, tokens):
    gen = torch.Generator().manual_seed(dim + tokens)
    wide = 5 * torch.randn(tokens, dim + 32, generator=gen)
    x = wide[:, 16:16 + dim]  # rows strided wider than dim
    weight = torch.randn(dim, generator=gen)
    got = cpu_pointwise.rms_norm(x, weight, 1e-5)
    assert got is not None
    torch.testing.assert_close(got, reference_norm(x, weight, 1e-5), atol=1e-5, rtol=1e-5)


def test_add_rms_norm_writes_the_sum_into_delta_only():
    gen = torch.Generator().manual_seed(1)
    residual, delta = torch.randn(9, 64, generator=gen), torch.randn(9, 64, generator=gen)
    weight = torch.randn(64, generator=gen)
    residual_before, want_sum = residual.clone(), residual + delta
    got = cpu_pointwise.add_rms_norm(residual, delta, weight, 1e-6)
    assert got is not None
    total, normed = got
    assert total.data_ptr() == delta.data_ptr()
    torch.testing.assert_close(total, want_sum)
    torch.testing.assert_close(residual, residual_before, atol=0, rtol=0)
    torch.testing.assert_close(normed, reference_norm(want_sum, weight, 1e-6), atol=1e-5,
                               rtol=1e-5)


def test_silu_mul_matches_pytorch_including_large_gates():
    gen = torch.Generator().manual_seed(2)
    gate_up = 4 * torch.randn(33, 2 * 688, generator=gen)
    gate_up[0, :8] = torch.tensor([-200.0, -90.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 200.0])
    got = cpu_pointwise.silu_mul(gate_up)
    assert got is not None
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(got, F.silu(gate) * up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_rotary_in_place_matches_apply_rotary(head_dim):
    """On q as a fused qkv projection yields it: a strided view, rotated in place."""
    gen = torch.Generator().manual_seed(head_dim)
    tokens, heads = 21, 3
    qkv = torch.randn(tokens, 2 * heads * head_dim, generator=gen)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    angles = torch.randn(tokens, head_dim // 2, generator=gen)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    want = apply_rotary(q, cos, sin)
    untouched = qkv[:, heads * head_dim:].clone()
    got = cpu_pointwise.rotary_(q, cos, sin)
    assert got is not None and got.data_ptr() == q.data_ptr()
    torch.testing.assert_close(q, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(qkv[:, heads * head_dim:], untouched, atol=0, rtol=0)


@pytest.mark.parametrize("case", ["bfloat16", "dim_24", "head_dim_16", "disabled"])
def test_declines_what_it_does_not_serve(case):
    x, weight = torch.randn(4, 32), torch.randn(32)
    q, cos = torch.randn(4, 2, 32), torch.randn(4, 32)
    if case == "bfloat16":
        x, q = x.bfloat16(), q.bfloat16()
    elif case == "dim_24":
        x, weight = torch.randn(4, 24), torch.randn(24)
    elif case == "head_dim_16":
        q, cos = torch.randn(4, 2, 16), torch.randn(4, 16)
    before = q.clone()
    with cpu_kernels.disabled() if case == "disabled" else contextlib.nullcontext():
        if case != "head_dim_16":
            assert cpu_pointwise.rms_norm(x, weight, 1e-5) is None
            assert cpu_pointwise.silu_mul(torch.cat([x, x], -1)) is None
        if case != "dim_24":
            assert cpu_pointwise.rotary_(q, cos, cos) is None
    torch.testing.assert_close(q, before, atol=0, rtol=0)  # a declined call writes nothing
