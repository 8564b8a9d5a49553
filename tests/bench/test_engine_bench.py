"""The engine benchmark harness on a minuscule model: JSON shape, skipped peers, greedy parity."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from kvserve.bench.engine_systems import KVServeRunner
from kvserve.bench.engine_workloads import (
    DECODE_HEAVY,
    SHARED_PREFIX,
    WorkloadSizes,
    build_workload,
)
from kvserve.cli import main
from kvserve.model import write_random_checkpoint
from kvserve.percentiles import percentile
from tests.model.arch_configs import base_config

SIZES = WorkloadSizes(num_prompts=3, prompt_len=9, output_len=6, prefix_len=20, suffix_len=5,
                      prefix_output_len=4, seed=7)
SIZE_FLAGS = ["--num-prompts", "3", "--prompt-len", "9", "--output-len", "6", "--prefix-len",
              "20", "--suffix-len", "5", "--prefix-output-len", "4", "--seed", "7"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("engine-bench") / "m",
                                   base_config(), seed=3)


def run_json(capsys, *argv: str) -> list[dict]:
    limits = [] if "--machine-limits" in argv else ["--no-machine-limits"]
    code = main(["bench", "engine", *argv, "--json", "--kv-cache-gib", "0.01", "--threads", "1",
                 "--max-model-len", "256", *SIZE_FLAGS, *limits])
    assert code == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_workloads_are_deterministic_and_shaped_as_asked():
    a, b = build_workload(SHARED_PREFIX, SIZES, 300), build_workload(SHARED_PREFIX, SIZES, 300)
    assert a == b
    assert {p[:20] for p in a.prompts} == {a.prompts[0][:20]}  # one shared prefix
    assert len({p[20:] for p in a.prompts}) == 3 and len(a.prompts[0]) == 25
    assert a.warmup_prompts[0][:20] != a.prompts[0][:20]  # warm-up never primes the cache
    d = build_workload(DECODE_HEAVY, SIZES, 300)
    assert len(d.prompts) == 3 and {len(p) for p in d.prompts} == {9} and d.max_tokens == 6
    assert all(4 <= t < 300 for p in d.prompts for t in p)
    assert build_workload(DECODE_HEAVY, WorkloadSizes(seed=8), 300).prompts != \
        build_workload(DECODE_HEAVY, WorkloadSizes(seed=9), 300).prompts


def test_percentile_interpolates_like_numpy():
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert percentile([], 50) is None


def test_json_shape_without_peers(capsys, model_dir):
    cells = run_json(capsys, "--model", str(model_dir), "--peer", "none")
    assert [c["workload"] for c in cells] == [DECODE_HEAVY, SHARED_PREFIX]
    for cell in cells:
        assert set(cell["systems"]) == {"kvserve"} and cell["ratios_kvserve_over"] == {}
        ours = cell["systems"]["kvserve"]
        assert ours["output_tokens"] == 3 * cell["max_tokens"]
        assert ours["output_tok_per_s"] > 0 and ours["seconds"] > 0
        assert 0 < ours["ttft_p50_s"] <= ours["ttft_p99_s"] <= ours["seconds"]
        assert ours["info"]["num_kv_blocks"] > 0


def test_precision_modes_run_as_systems_with_their_shares_of_the_limits(capsys, model_dir,
                                                                        monkeypatch):
    monkeypatch.setattr("kvserve.bench.machine.BANDWIDTH_BYTES", 32 << 20)
    monkeypatch.setattr("kvserve.bench.machine.GEMM_SHAPES",
                        ((1, 128, 128), (16, 128, 128), (512, 128, 128)))
    cells = run_json(capsys, "--model", str(model_dir), "--peer", "none", "--workload",
                     DECODE_HEAVY, "--precision", "float32", "q8_0", "--machine-limits")
    (cell,) = cells
    assert list(cell["systems"]) == ["kvserve", "kvserve-q8_0"]
    assert cell["ratios_kvserve_over"] == {}  # modes of kvserve are not peers
    q8 = cell["systems"]["kvserve-q8_0"]
    assert q8["info"]["quantization"] == "q8_0" and q8["output_tokens"] == 3 * 6
    assert 0 <= q8["parity_vs_kvserve"] <= 1  # greedy agreement with float32
    assert cell["machine"]["read_gb_s"] > 0
    for system in cell["systems"].values():
        share = system["info"]["of_limits"]
        assert share["weight_gb_s"] > 0 and share["gflops"] > 0
        assert share["of_read_bandwidth"] == pytest.approx(
            share["weight_gb_s"] / cell["machine"]["read_gb_s"])
    # 8-bit weights: fewer bytes a step than float32's, at the same step rate or a faster one.
    fp32, q8i = (cell["systems"][s]["info"]["of_limits"] for s in ("kvserve", "kvserve-q8_0"))
    fp32_steps = cell["systems"]["kvserve"]["output_tok_per_s"]
    q8_steps = q8["output_tok_per_s"]
    assert q8i["weight_gb_s"] / q8_steps < fp32["weight_gb_s"] / fp32_steps


def test_an_absent_peer_is_reported_as_skipped(capsys, model_dir, monkeypatch):
    monkeypatch.setenv("KVSERVE_VLLM_PYTHON", str(model_dir / "no-such-python"))
    cells = run_json(capsys, "--model", str(model_dir), "--peer", "vllm",
                     "--workload", DECODE_HEAVY)
    assert len(cells) == 1
    assert "not installed" in cells[0]["systems"]["vllm"]["skipped"]
    assert cells[0]["ratios_kvserve_over"] == {}


def test_unknown_model_is_a_clear_error(capsys):
    assert main(["bench", "engine", "--model", "no-such-model", "--peer", "none"]) == 2
    assert "not one of tiny, 100m" in capsys.readouterr().err


@pytest.mark.parametrize("workload", [DECODE_HEAVY, SHARED_PREFIX])
def test_kvserve_greedy_equals_hf_on_the_workload(model_dir, workload):
    pytest.importorskip("transformers")
    from kvserve.bench.engine_systems import HFRunner

    w = build_workload(workload, SIZES, 300)
    ours = KVServeRunner(str(model_dir), 16 << 20, num_threads=1, max_model_len=256)
    hf = HFRunner(str(model_dir), num_threads=1)
    try:
        mine, theirs = ours.run(w), hf.run(w)
    finally:
        ours.close()
        hf.close()
    assert mine.output_token_ids == theirs.output_token_ids
    assert all(len(t) == w.max_tokens for t in mine.output_token_ids)
    assert theirs.num_output_tokens == mine.num_output_tokens == 3 * w.max_tokens


def test_a_failing_peer_is_reported_as_skipped(capsys, model_dir, monkeypatch):
    # This interpreter has no vLLM: the driver starts, fails to import it and exits non-zero.
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this interpreter has vLLM; the test needs one without it")
    monkeypatch.setenv("KVSERVE_VLLM_PYTHON", sys.executable)
    cells = run_json(capsys, "--model", str(model_dir), "--peer", "vllm",
                     "--workload", SHARED_PREFIX)
    assert cells[0]["systems"]["vllm"]["skipped"].startswith("driver failed")
    assert cells[0]["systems"]["kvserve"]["output_tokens"] == 3 * 4
