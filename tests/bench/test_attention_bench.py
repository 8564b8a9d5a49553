"""`python -m benchmarks attention` on the tiny model's shapes: every call is checked against
PyTorch's before it is timed, and each row reports both systems."""

from __future__ import annotations

import json

import pytest

from benchmarks.__main__ import main
from kvserve.model import cpu_kernels


@pytest.mark.skipif(not cpu_kernels.available("attention"),
                    reason="kvserve's CPU kernels are not available here (needs x86-64 with "
                           "AVX-512 and a C compiler)")
def test_a_tiny_run_reports_every_call(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["attention", "--model", "tiny", "--repeats", "1", "--threads", "1",
                 "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["call"] for r in rows] == [
        "prefill causal 1056", "prefill cascade head 992x1024", "decode cascade head 32x1024",
        "paged decode 32x256"]
    for row in rows:
        assert row["model"] == "tiny" and row["kvserve_ms"] > 0 and row["pytorch_ms"] > 0
        assert row["speedup"] == pytest.approx(row["pytorch_ms"] / row["kvserve_ms"])


def test_bad_repeats_is_a_clear_error() -> None:
    with pytest.raises(SystemExit, match="--repeats and --threads must be at least 1"):
        main(["attention", "--repeats", "0"])
