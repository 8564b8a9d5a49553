"""`python -m benchmarks lora`: every case runs on a tiny checkpoint and reports its ratios; with
`--peer vllm` the same cases run through vLLM's CPU build, whose absence is named, whose
failure becomes error rows, and whose greedy tokens are compared with kvserve's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.__main__ import main
from benchmarks.lora_peer import Case, Workload, agreement, driver_spec, vllm_max_lora_rank
from kvserve.bench.peers_env import vllm_python
from kvserve.model import write_random_checkpoint
from tests.model.arch_configs import base_config

SMALL = ["--adapters", "2", "--rank", "8", "--num-prompts", "3", "--prompt-len", "8",
         "--max-tokens", "3", "--num-threads", "1", "--json"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 64: vLLM's CPU attention refuses the default tiny config's 16.
    config = base_config(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=192)
    return write_random_checkpoint(tmp_path_factory.mktemp("lora_bench") / "m", config, seed=3)


def run_rows(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[dict], str]:
    """Exit code, the JSON rows and stderr of one `python -m benchmarks lora` run."""
    code = main(["lora", *argv])
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines() if line.startswith("{")], err


def test_the_three_cases_run_on_kvserve_with_ratios_to_the_base(
        model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, rows, _ = run_rows(capsys, "--model", str(model_dir), *SMALL)
    assert code == 0
    assert [r["case"] for r in rows] == ["base model, LoRA off", "LoRA on, all requests base",
                                         "LoRA on, 2 adapters (rank 8) mixed"]
    assert {r["system"] for r in rows} == {"kvserve"} and rows[0]["vs_kvserve_base"] == 1.0
    assert all(r["output_tok_s"] > 0 and r["threads"] == 1 for r in rows)


def test_a_missing_vllm_says_how_to_install_it_before_anything_runs(
        model_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    monkeypatch.setenv("KVSERVE_VLLM_PYTHON", str(tmp_path / "absent"))
    code, rows, err = run_rows(capsys, "--model", str(model_dir), *SMALL, "--peer", "vllm")
    assert (code, rows) == (2, [])
    assert "install it as docs/peers.md says" in err


def test_a_failing_vllm_driver_becomes_error_rows_and_a_nonzero_exit(
        model_dir: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # kvserve's own interpreter has no vllm: the driver starts, fails to import it, and says so.
    monkeypatch.setenv("KVSERVE_VLLM_PYTHON", sys.executable)
    code, rows, _ = run_rows(capsys, "--model", str(model_dir), *SMALL, "--peer", "vllm")
    peer = [r for r in rows if r.get("system") == "vllm"]
    assert code == 1 and len(peer) == 3
    assert all("vLLM driver failed" in r["error"] and "vllm" in r["error"] for r in peer)
    assert all(r["kvserve_over_vllm"] is None for r in rows if r.get("system") == "kvserve")


def test_agreement_counts_equal_prompts_and_tokens_before_the_first_difference() -> None:
    assert agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]]) == {
        "prompts_equal": "1/2", "leading_tokens_equal": "4/6"}


def test_the_driver_spec_gives_vllm_the_same_prompts_adapters_and_limits() -> None:
    workload = Workload(prompts=[[5, 6], [7, 8, 9]], warmup_prompts=[[1], [2], [3]],
                        adapters=[("a0", 1, "/x/a0"), ("a1", 2, "/x/a1")], rank=12,
                        max_tokens=4)
    mixed = Case("mixed", True, [0, 1])
    spec = driver_spec(Path("/m"), workload, [Case("base", True, [None, None]), mixed], 2, 1 << 20)
    assert spec["lora"] == {"max_loras": 2, "max_lora_rank": 16, "max_cpu_loras": 2}
    assert spec["max_model_len"] == 3 + 4 and spec["max_num_seqs"] == 3
    base_case, mixed_case = spec["cases"]
    assert mixed_case["prompts"] == workload.prompts and mixed_case["adapter_idx"] == [0, 1]
    assert mixed_case["warmup_adapter_idx"] == [0, 1, 0]  # every adapter loaded before timing
    assert base_case["warmup_adapter_idx"] == [None, None, None]
    assert driver_spec(Path("/m"), workload, [Case("off", False, [None, None])], 1,
                       1 << 20)["lora"] is None
    with pytest.raises(ValueError, match="largest max_lora_rank"):
        vllm_max_lora_rank(1024)


@pytest.mark.skipif(vllm_python() is None,
                    reason="vLLM's CPU build is not installed (docs/peers.md: $PEERS/vllm-cpu, or "
                    "KVSERVE_VLLM_PYTHON); the vLLM side of `benchmarks lora` is not tested")
def test_vllm_runs_every_case_and_its_greedy_tokens_equal_kvserves(
        model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, rows, _ = run_rows(capsys, "--model", str(model_dir), *SMALL, "--peer", "vllm")
    assert code == 0
    assert [r["case"] for r in rows if r.get("system") == "vllm"] == [
        r["case"] for r in rows if r.get("system") == "kvserve"]
    assert all(r["output_tok_s"] > 0 for r in rows if "system" in r)
    assert [r["prompts_equal"] for r in rows if "prompts_equal" in r] == ["3/3"] * 3
