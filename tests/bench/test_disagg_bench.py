"""`python -m benchmarks disagg` end to end on a very small model: both fleets start, the mix
runs, and the disaggregated fleet's report counts KV blocks actually transferred."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.__main__ import main
from kvserve.model import write_random_checkpoint
from tests.bench.tiny_model import TINY


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("disagg-bench") / "tiny", TINY,
                                   seed=5)


def test_a_short_run_reports_both_fleets_and_the_transfer(model_dir: Path, capsys) -> None:
    code = main(["disagg", "--model", str(model_dir), "--duration", "1.5",
                 "--warmup", "0.5", "--num-decoders", "2", "--decode-output-len", "8",
                 "--long-prompt-len", "80", "--long-every", "0.4", "--max-model-len", "256",
                 "--kv-cache-memory-bytes", str(1 << 22), "--decode-host-tier-bytes",
                 str(1 << 22), "--max-num-batched-tokens", "256", "--json"])
    assert code == 0
    rows = {r["mode"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(rows) == {"unified", "disaggregated"}
    for row in rows.values():
        assert row["failed"] == 0 and row["itl_samples"] > 0 and row["long_prompts"] >= 2
        assert row["itl_p50_ms"] <= row["itl_p99_ms"] <= row["itl_max_ms"]
    assert rows["unified"]["transfer_blocks"] == 0
    split = rows["disaggregated"]
    assert split["transfer_blocks"] >= 4 * rows["disaggregated"]["long_prompts"]  # 4 per prompt
    assert split["transfer_ms_per_block"] > 0 and not math.isnan(split["transfer_mb_per_s"])


def test_bad_modes_are_refused_before_anything_starts(capsys) -> None:
    assert main(["disagg", "--modes", "split"]) == 2
    assert "--modes" in capsys.readouterr().err
