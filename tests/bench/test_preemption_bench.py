"""`python -m benchmarks preemption` on a tiny run: both modes give the same tokens, swap mode
recomputes nothing, and every preemption of swap mode is a swap."""

from __future__ import annotations

import json

import pytest

from benchmarks.__main__ import main


def test_a_tiny_run_compares_swap_and_recompute(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["preemption", "--num-prompts", "4", "--prompt-len", "16",
                 "--output-len", "16", "--num-kv-blocks", "4", "--threads", "1",
                 "--no-recompute-host-tier", "--json"]) == 0
    rows = {row["mode"]: row for row in map(json.loads, capsys.readouterr().out.splitlines())}
    floor = 4 * (16 + 15)
    assert rows["swap"]["computed_tokens"] == floor
    assert rows["swap"]["swap_preemptions"] == rows["swap"]["preemptions"] > 0
    assert rows["recompute"]["computed_tokens"] > floor and rows["recompute"]["preemptions"] > 0
    assert rows["recompute"]["swap_preemptions"] == 0
    assert rows["swap"]["same_tokens"] and rows["recompute"]["same_tokens"]
