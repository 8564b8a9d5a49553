"""`kvserve bench machine`: it runs, and its figures are positive and agree with each other."""

from __future__ import annotations

import json
import math

import pytest

from kvserve.bench.machine import (
    BYTES_PER_WEIGHT,
    KERNELS,
    MachineLimits,
    fraction_of_limit,
    matmul_params,
    measure,
    weight_bytes_per_token,
)
from kvserve.cli import main

# Small GEMMs: this file checks that every kernel is measured and labelled, not the rates (a
# 2048-wide bf16 GEMM on a CPU without bf16 instructions takes seconds).
SHAPES = ((1, 128, 128), (16, 128, 128), (512, 128, 128))
SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
           "num_key_value_heads": 3, "num_hidden_layers": 30, "vocab_size": 49152}


def test_measure_reports_positive_finite_limits_for_every_kernel() -> None:
    limits = measure(threads=1, repeats=1, bandwidth_bytes=64 << 20, gemm_shapes=SHAPES)
    assert limits.threads == 1 and set(limits.gemm_gflops) == set(KERNELS)
    for rates in limits.gemm_gflops.values():
        assert list(rates) == ["M=1", "M=16", "M=512"]
        assert all(math.isfinite(v) and v > 0 for v in rates.values())
    assert limits.read_gb_s > 0 and limits.copy_gb_s > 0
    # The bound a mode is held to is one of the measured rates.
    assert limits.gemm_limit("float32", large=True) == limits.gemm_gflops["float32"]["M=512"]
    assert limits.gemm_limit("q4_1", large=False) == max(
        limits.gemm_gflops["float32"]["M=1"], limits.gemm_gflops["float32"]["M=16"])
    assert limits.gemm_limit("int8", large=True) == limits.gemm_gflops["int8"]["M=512"]


@pytest.mark.parametrize("has_onednn_bf16", [True, False])
def test_bf16_is_measured_on_every_cpu_and_says_which_path(
        has_onednn_bf16: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Without AVX-512 BF16/BW or AMX oneDNN refuses a bf16 weight; the figure then comes from
    # ATen's path, and the kernel note says kvserve runs float32 there.
    import torch

    if has_onednn_bf16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU lacks oneDNN's bf16 instructions (AVX-512 BF16/BW or AMX)")
    monkeypatch.setattr("kvserve.bench.machine.onednn_bf16", lambda: has_onednn_bf16)
    limits = measure(threads=1, repeats=1, bandwidth_bytes=16 << 20, gemm_shapes=SHAPES)
    assert all(v > 0 for v in limits.gemm_gflops["bfloat16"].values())
    assert ("runs float32 here" in limits.kernels["bfloat16"]) is not has_onednn_bf16


def test_bytes_per_token_follow_the_weight_formats() -> None:
    layers, head = matmul_params(SMOLLM2)
    # SmolLM2-135M: 30 layers of q/k/v/o (576x576 x2, 576x192 x2) and a 576x1536 MLP.
    assert layers == 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536)
    assert head == 576 * 49152
    fp32, bf16 = (weight_bytes_per_token(SMOLLM2, m) for m in ("float32", "bfloat16"))
    q4, q8 = (weight_bytes_per_token(SMOLLM2, m) for m in ("q4_1", "q8_0"))
    assert fp32 == 2 * bf16 == 4 * (layers + head)
    assert q4 == layers * 20 / 32 + head * BYTES_PER_WEIGHT["q8_0"] < q8 < bf16
    assert weight_bytes_per_token(SMOLLM2, "w8a8") == layers + 2 * head  # int8; bf16 lm_head


def test_shares_of_the_limits_are_consistent() -> None:
    limits = MachineLimits(threads=2, gemm_gflops={
        "float32": {"M=1": 10.0, "M=16": 40.0, "M=512": 200.0},
        "bfloat16": {"M=1": 20.0, "M=16": 80.0, "M=512": 800.0}}, read_gb_s=20.0)
    one = fraction_of_limit(SMOLLM2, "float32", limits, tokens_per_s=30.0, concurrency=1,
                            total_tokens_per_s=30.0)
    assert one["weight_gb_s"] == pytest.approx(30 * weight_bytes_per_token(SMOLLM2, "float32")
                                               / 1e9)
    assert one["of_read_bandwidth"] == pytest.approx(one["weight_gb_s"] / 20.0)
    assert one["of_gemm_rate"] == pytest.approx(one["gflops"] / 40.0)  # decode: best small M
    # 64 sequences a step: the weights are read once for all of them, and the prefill-sized
    # GEMM rate is the bound.
    many = fraction_of_limit(SMOLLM2, "bfloat16", limits, tokens_per_s=640.0, concurrency=64,
                             total_tokens_per_s=1280.0)
    assert many["weight_gb_s"] == pytest.approx(10 * weight_bytes_per_token(SMOLLM2, "bfloat16")
                                                / 1e9)
    assert many["of_gemm_rate"] == pytest.approx(many["gflops"] / 800.0)


def test_the_cli_prints_one_json_object(capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvserve.bench.machine.BANDWIDTH_BYTES", 32 << 20)
    monkeypatch.setattr("kvserve.bench.machine.GEMM_SHAPES", SHAPES)
    assert main(["bench", "machine", "--threads", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["threads"] == 1 and data["read_gb_s"] > 0
    assert set(data["kernels"]) == {"float32", "bfloat16", "int8"}


def test_a_bf16_run_that_fell_back_to_float32_is_held_to_float32s_limits(tmp_path) -> None:
    from kvserve.bench.engine_cli import add_limit_shares
    from kvserve.bench.engine_systems import RunResult
    from kvserve.bench.engine_workloads import Workload

    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    limits = MachineLimits(threads=2, gemm_gflops={
        "float32": {"M=1": 10.0, "M=16": 40.0, "M=512": 200.0},
        "bfloat16": {"M=1": 2.0, "M=16": 3.0, "M=512": 3.0}}, read_gb_s=20.0)
    work = Workload("w", ((1,) * 8,), 4, (), 0)
    runs = [RunResult("kvserve", seconds=1.0, num_output_tokens=4, info={"ran_dtype": ran})
            for ran in ("float32", "bfloat16")]
    add_limit_shares(tmp_path, "bfloat16", [work, work], runs, limits)
    fell_back, native = (r.info["of_limits"] for r in runs)
    assert fell_back["weight_gb_s"] == pytest.approx(
        4 * weight_bytes_per_token(SMOLLM2, "float32") / 1e9)
    assert native["weight_gb_s"] == pytest.approx(fell_back["weight_gb_s"] / 2)
    assert fell_back["of_gemm_rate"] == pytest.approx(fell_back["gflops"] / 40.0)
