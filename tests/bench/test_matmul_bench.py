"""`python -m benchmarks matmul` at a few rows: every shape reports the three systems, and the
ratios are the rates' own."""

from __future__ import annotations

import json

import pytest

from benchmarks.__main__ import main
from benchmarks.matmul_cli import SHAPES
from kvserve.model.int8_linear import int8_kernel_serves


@pytest.mark.skipif(not int8_kernel_serves(),
                    reason="kvserve's int8 kernel serves x86-64 CPUs with AVX512-VNNI")
def test_a_small_run_reports_every_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["matmul", "--rows", "3", "--repeats", "1", "--threads", "1", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["m"], r["n"], r["k"]) for r in rows] == [(3, n, k) for n, k in SHAPES]
    for row in rows:
        assert min(row["kvserve_int8_gops"], row["kvserve_bf16_gops"],
                   row["onednn_int8_gops"], row["q4_1_blocks_gops"],
                   row["q4_1_float32_gops"]) > 0
        assert row["int8_over_bf16"] == pytest.approx(
            row["kvserve_int8_gops"] / row["kvserve_bf16_gops"], rel=0.02, abs=0.01)


def test_bad_rows_is_a_clear_error() -> None:
    with pytest.raises(SystemExit, match="--rows must be at least 1"):
        main(["matmul", "--rows", "0"])
