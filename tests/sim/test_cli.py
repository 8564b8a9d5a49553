"""`kvserve simulate` end to end: table, JSON and plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.cli import main


def test_simulate_writes_a_table_json_and_plots(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib draws the plots (pip install it)")
    out = tmp_path / "out"
    code = main(["simulate", "--trace", "multi-tenant", "--tenants", "4", "--requests", "40",
                 "--rate", "2", "--workers", "2", "--capacity-tokens", "80000",
                 "--block-size", "64", "--policy", "round_robin,prefix_hash",
                 "--clients", "patient,retry-bp", "--jobs", "1", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "prefix_hash [retry-bp]" in printed and "hit rate" in printed
    doc = json.loads((out / "results.json").read_text())
    assert [r["label"] for r in doc["runs"]] == [
        "round_robin [patient]", "prefix_hash [patient]",
        "round_robin [retry-bp]", "prefix_hash [retry-bp]"]
    assert all(r["audit_ok"] and r["timeline"] and r["ttfts"] for r in doc["runs"])
    for name in ("hit_rate.png", "ttft_cdf.png", "load.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"


def test_simulate_in_parallel_processes_gives_the_serial_result(tmp_path: Path) -> None:
    args = ["simulate", "--trace", "multi-tenant", "--tenants", "4", "--requests", "30",
            "--workers", "2", "--capacity-tokens", "80000", "--block-size", "64",
            "--policy", "round_robin,cache_aware", "--json"]
    runs = []
    for jobs in ("1", "2"):
        out = tmp_path / jobs
        assert main([*args, "--jobs", jobs, "--out", str(out)]) == 0
        doc = json.loads((out / "results.json").read_text())
        runs.append([{k: v for k, v in r.items() if k not in ("wall_s",)} for r in doc["runs"]])
    assert runs[0] == runs[1]


def test_simulate_explains_a_bad_argument(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--trace", "multi-tenant", "--policy", "precise"]) == 2
    assert "cannot be simulated" in capsys.readouterr().err
    assert main(["simulate", "--trace", "/nonexistent.jsonl"]) == 2


def test_policy_variants_run_side_by_side_and_differ(tmp_path: Path) -> None:
    """`POLICY@KEY=VALUE` runs the real policy with that option: with no weight on the prefill
    backlog, cache_aware places this workload's tenants differently."""
    out = tmp_path / "out"
    assert main(["simulate", "--trace", "multi-tenant", "--tenants", "10", "--requests", "60",
                 "--rate", "12", "--prefix-tokens", "2048,3072", "--suffix-tokens", "32,96",
                 "--output-tokens", "16", "--workers", "2", "--capacity-tokens", "16384",
                 "--max-num-seqs", "16", "--max-num-batched-tokens", "2048",
                 "--profile", "h100", "--policy",
                 "cache_aware@backlog_weight=0,cache_aware@backlog_weight=4",
                 "--jobs", "1", "--json", "--out", str(out)]) == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [r["label"] for r in runs] == ["cache_aware@backlog_weight=0",
                                          "cache_aware@backlog_weight=4"]
    assert [w["routed"] for w in runs[0]["workers"]] != [w["routed"] for w in runs[1]["workers"]]


def test_a_bad_policy_option_is_refused_before_any_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--trace", "multi-tenant", "--policy", "cache_aware@nope=1"]) == 2
    assert "has no option nope" in capsys.readouterr().err
    assert main(["simulate", "--trace", "multi-tenant", "--policy", "cache_aware@x"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


def test_simulate_an_adapter_workload_reports_loads_per_request(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["simulate", "--trace", "multi-tenant", "--tenants", "8", "--requests", "60",
                 "--rate", "12", "--skew", "0", "--prefix-tokens", "512,1024",
                 "--suffix-tokens", "32,96", "--output-tokens", "8", "--workers", "2",
                 "--profile", "h100", "--adapters", "6", "--max-loras", "2",
                 "--adapter-load-ms", "30", "--policy", "cache_aware,lora_affinity",
                 "--jobs", "1", "--out", str(out)]) == 0
    assert "loads/req" in capsys.readouterr().out
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert all(r["adapter_loads"] > 0 and r["audit_ok"] for r in runs)
    assert all(r["adapter_loads_per_request"] == r["adapter_loads"] / r["num_ok"] for r in runs)
    assert main(["simulate", "--trace", "multi-tenant", "--adapters", "2",
                 "--max-loras", "0"]) == 2
    assert "--max-loras >= 1" in capsys.readouterr().err
