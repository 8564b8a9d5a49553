"""`python -m benchmarks.gateway_keys`: one small run keys every request exactly as a full
tokenization does, and takes the memo's splice path for all but each tenant's first request."""

from __future__ import annotations

import re

import pytest

from benchmarks.gateway_keys import main
from kvserve.runtime.demo_model import ensure_demo_model


def test_a_small_run_splices_every_repeat_visit_and_keys_exactly(
        capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", str(ensure_demo_model()), "--tenants", "3", "--requests", "24",
            "--prefix-tokens", "600,900", "--suffix-tokens", "8,40", "--passes", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    counts = {k: int(v) for k, v in re.findall(r"(exact|splice|fallback|miss) (\d+)", out)}
    assert counts == {"exact": 0, "splice": 48 - 6, "fallback": 0, "miss": 6}, out
    assert "keys differing from a full tokenization's: 0" in out
    assert re.search(r"before \(full tokenization\): p50 +\d+\.\d{3}", out)
