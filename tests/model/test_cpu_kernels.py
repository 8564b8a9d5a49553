"""kvserve's CPU kernels: the build, and the fused position-wise ops against PyTorch's."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvserve.model import cpu_kernels, cpu_pointwise
from kvserve.model.layers import RMSNorm
from kvserve.model.rotary import apply_rotary

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available("pointwise"),
    reason="kvserve's CPU kernels are not available here (needs x86-64 with AVX-512 or AVX2 "
           "and a C compiler)")


def test_one_build_is_shared_by_later_loads(tmp_path, monkeypatch):
    """The library is built once into the cache dir, keyed by its sources; a second build
    call finds it instead of compiling again, and no temporary file is left."""
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    compiler = cpu_kernels.find_compiler()
    assert compiler is not None
    first = cpu_kernels.build(compiler, cpu_kernels.kernel_set() or "avx512")
    assert first.parent == tmp_path / "kernels" and first.exists()
    mtime = first.stat().st_mtime_ns
    assert cpu_kernels.build(compiler, cpu_kernels.kernel_set() or "avx512") == first
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


def assert_bf16_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 results: at least 99% bit-identical, the rest one bf16 step away (summation order
    and exp's approximation move a few values across a rounding boundary; a missing or extra
    rounding moves far more)."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    steps = (got.contiguous().view(torch.int16).int() - want.contiguous().view(torch.int16).int())
    assert int(steps.abs().max()) <= 1, f"off by {int(steps.abs().max())} bf16 steps"
    assert float((steps == 0).float().mean()) >= 0.99, float((steps == 0).float().mean())


def test_bfloat16_rms_norm_and_its_residual_add_round_as_pytorch():
    gen = torch.Generator().manual_seed(3)
    residual = (3 * torch.randn(37, 576, generator=gen)).bfloat16()
    delta = torch.randn(37, 576, generator=gen).bfloat16()
    weight = torch.randn(576, generator=gen).bfloat16()
    want_sum = residual + delta  # bf16 + bf16: one rounding of the float32 sum
    got = cpu_pointwise.rms_norm(residual, weight, 1e-5)
    assert got is not None
    assert_bf16_matches(got, reference_norm(residual, weight, 1e-5))
    fused = cpu_pointwise.add_rms_norm(residual, delta, weight, 1e-5)
    assert fused is not None
    total, normed = fused
    torch.testing.assert_close(total, want_sum, atol=0, rtol=0)
    assert_bf16_matches(normed, reference_norm(want_sum, weight, 1e-5))


def test_bfloat16_silu_mul_rounds_as_pytorch():
    gen = torch.Generator().manual_seed(4)
    gate_up = (4 * torch.randn(33, 2 * 1536, generator=gen)).bfloat16()
    gate_up[0, :8] = torch.tensor([-200.0, -90.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 200.0])
    got = cpu_pointwise.silu_mul(gate_up)
    assert got is not None
    gate, up = gate_up.chunk(2, dim=-1)
    assert_bf16_matches(got, F.silu(gate) * up)


def test_bfloat16_rotary_rounds_once():
    """bf16 q rotated by float32 tables in float32, the result rounded once: closer to the exact
    rotation than PyTorch's bf16 ops, which round the tables and every step."""
    gen = torch.Generator().manual_seed(5)
    tokens, heads, head_dim = 19, 9, 64
    qkv = torch.randn(tokens, 2 * heads * head_dim, generator=gen).bfloat16()
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    angles = 50 * torch.randn(tokens, head_dim // 2, generator=gen)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    exact = apply_rotary(q.double(), cos.double(), sin.double())
    want = apply_rotary(q.float(), cos, sin).bfloat16()
    by_torch = apply_rotary(q, cos, sin)
    got = cpu_pointwise.rotary_(q, cos, sin)
    assert got is not None and got.data_ptr() == q.data_ptr()
    assert_bf16_matches(q, want)
    assert (q.double() - exact).abs().mean() < (by_torch.double() - exact).abs().mean()


@pytest.mark.parametrize("case", ["float16", "mixed_dtypes", "dim_20", "head_dim_12",
                                  "disabled"])
def test_declines_what_it_does_not_serve(case):
    """Other dtypes, and dims that neither set's vectors divide (AVX-512 reads 16 lanes, AVX2
    8)."""
    x, weight = torch.randn(4, 32), torch.randn(32)
    q, cos = torch.randn(4, 2, 32), torch.randn(4, 32)
    if case == "float16":
        x, weight, q = x.half(), weight.half(), q.half()
    elif case == "mixed_dtypes":  # bf16 activations, a float32 norm weight and bf16 tables
        x, q, cos = x.bfloat16(), q.bfloat16(), cos.bfloat16()
    elif case == "dim_20":
        x, weight = torch.randn(4, 20), torch.randn(20)
    elif case == "head_dim_12":
        q, cos = torch.randn(4, 2, 12), torch.randn(4, 12)
    before = q.clone()
    with cpu_kernels.disabled() if case == "disabled" else contextlib.nullcontext():
        if case != "head_dim_12":
            assert cpu_pointwise.rms_norm(x, weight, 1e-5) is None
        if case not in ("head_dim_12", "mixed_dtypes"):  # silu_mul has one operand
            assert cpu_pointwise.silu_mul(torch.cat([x, x], -1)) is None
        if case != "dim_20":
            assert cpu_pointwise.rotary_(q, cos, cos) is None
    torch.testing.assert_close(q, before, atol=0, rtol=0)  # a declined call writes nothing


def test_the_kernel_set_follows_the_cpu_and_the_override(monkeypatch):
    capability = torch.backends.cpu.get_cpu_capability()
    monkeypatch.delenv("KVSERVE_CPU_KERNELS_ISA", raising=False)
    native = cpu_kernels.kernel_set()
    assert native == {"AVX512": "avx512", "AVX2": "avx2"}[capability]
    monkeypatch.setenv("KVSERVE_CPU_KERNELS_ISA", "avx2")
    assert cpu_kernels.kernel_set() == "avx2"  # the AVX2 set runs on AVX-512 CPUs too
    monkeypatch.setenv("KVSERVE_CPU_KERNELS_ISA", "sse2")
    assert cpu_kernels.kernel_set() == native  # an unknown value is ignored (with a warning)


def test_the_avx2_set_matches_pytorch_in_its_own_process():
    """The AVX2 set on whatever CPU runs the tests (on an AVX-512 CPU, forced by the override):
    the kernel tests of the families it has, again, in a process that builds only that set."""
    if cpu_kernels.kernel_set() == "avx2" and "KVSERVE_CPU_KERNELS_ISA" not in os.environ:
        pytest.skip("this CPU's own set is the AVX2 one: this process's tests ran it")
    env = dict(os.environ, KVSERVE_CPU_KERNELS_ISA="avx2")
    here = Path(__file__).parent
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-x", __file__,
         str(here / "test_cpu_attention.py"), str(here / "test_decode_step.py"),
         f"{here / 'test_quant_linear.py'}::test_every_path_computes_the_dequantized_matmul",
         f"{here / 'test_quant_linear.py'}::test_many_rows_keep_the_int16_numerics",
         "-k", "not own_process and not follows_the_cpu"],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-2000:]


def test_families_are_the_sets_own():
    assert set(cpu_kernels.families()) == {
        "avx512": {"attention", "paged_decode", "pointwise", "quant", "bf16_matmul",
                   "int8_matmul", "decode_step"},
        "avx2": {"paged_decode", "pointwise", "quant", "decode_step"},
    }[cpu_kernels.kernel_set() or ""]
