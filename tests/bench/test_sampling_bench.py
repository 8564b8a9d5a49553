"""`python -m benchmarks sampling`: every mode at every row count, and one stream's ITL by mode
on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.__main__ import main
from benchmarks.sampling_cli import ENGINE_MODES, MODES
from kvserve.model import write_random_checkpoint
from tests.bench.tiny_model import TINY


def test_every_mode_is_timed_at_every_row_count_and_in_one_stream(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = write_random_checkpoint(tmp_path / "tiny", TINY, seed=5)
    assert main(["sampling", "--rows", "1", "3", "--vocab", "500", "--repeats", "2",
                 "--threads", "1", "--model", str(model_dir), "--output-len", "4",
                 "--rounds", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["sampler_ms"]) == set(MODES)
    for by_rows in result["sampler_ms"].values():
        assert set(by_rows) == {"1", "3"} and min(by_rows.values()) > 0
    assert set(result["itl_ms"]) == set(ENGINE_MODES)
    assert all(len(itls) == 2 for itls in result["itl_ms"].values())


def test_bad_arguments_are_a_clear_error() -> None:
    with pytest.raises(SystemExit, match="--rows, --repeats and --threads must be at least 1"):
        main(["sampling", "--rows", "0"])
    with pytest.raises(SystemExit, match="--output-len must be at least 2"):
        main(["sampling", "--output-len", "1"])
