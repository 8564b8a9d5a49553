"""`python -m benchmarks text-capacity`: a tiny run prints its three tables' figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.__main__ import main
from benchmarks.text_capacity_cli import chat_prompts
from kvserve.gateway.fleet import text_capacity
from kvserve.model.demo_tokenizer import build_tokenizer


def test_a_tiny_run_prints_cost_error_and_rescale_figures(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build_tokenizer(300).save(str(tmp_path / "tokenizer.json"))
    change = text_capacity.RESCALE_CHANGE
    assert main(["text-capacity", "--tokenizer", str(tmp_path), "--tokens", "64",
                 "--every", "1,32", "--repeats", "2", "--samples", "1,4,8", "--changes",
                 "0.05,0.9", "--draws", "8", "--orders", "3", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(figures["load_average"]) == 3
    [cost] = figures["cost"]
    assert cost["tokens"] == 64 and cost["chars"] > 64
    assert cost["every_32_ms"] == pytest.approx(cost["encode_ms"] / 32)
    assert [r["samples"] for r in figures["error"]] == [1, 4, 8]
    assert all(0 <= r["median"] <= r["p90"] <= r["max"] for r in figures["error"])
    strict, loose = figures["rescale"]
    assert (strict["change"], loose["change"]) == (0.05, 0.9)
    # the tiny tokenizer's ~1.3 characters a token is 67 % off the assumed 4: only 0.05 follows
    assert strict["rescales_median"] >= 1 and strict["final_error_max"] < 0.05
    assert loose["rescales_max"] == 0 and loose["final_error_median"] > 1
    assert change == text_capacity.RESCALE_CHANGE  # restored after the run


def test_every_user_turn_is_one_prompt_that_starts_with_its_system_prompt() -> None:
    prompts = chat_prompts()
    assert len(prompts) > 40
    assert all(p.count("\n\nUser: ") >= 1 for p in prompts)
