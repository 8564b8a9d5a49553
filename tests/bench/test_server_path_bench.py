"""`python -m benchmarks server-path` on a tiny random model: both sides, interleaved, parsed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.__main__ import main
from kvserve.model import write_random_checkpoint
from tests.bench.tiny_model import TINY


def test_each_instance_is_a_fresh_pair_of_processes_reporting_every_repeat(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = write_random_checkpoint(tmp_path / "tiny", TINY, seed=5)
    code = main(["server-path", "--model", str(model_dir), "--num-prompts", "2",
                 "--input-len", "16", "--output-len", "5", "--repeats", "2", "--threads", "1",
                 "--instances", "2"])
    assert code == 0
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert "server / offline ITL, per interleaved repeat: median" in out and "4 pairs" in out
    assert [(r["side"], r["instance"], r["repeat"]) for r in rows] == [
        ("offline", 0, 0), ("server", 0, 0), ("offline", 0, 1), ("server", 0, 1),
        ("offline", 1, 2), ("server", 1, 2), ("offline", 1, 3), ("server", 1, 3)]
    for row in rows:
        assert row["tokens"] == 2 * 4  # two prompts, the gaps after each first token
        # a loaded client may read a tiny model's whole stream in one recv: a served ITL of 0
        assert row["itl_ms"] > 0 if row["side"] == "offline" else row["itl_ms"] >= 0
        assert row["cpu_ms_per_token"] >= 0
        assert (row["client_cpu_ms_per_token"] is None) == (row["side"] == "offline")
    medians = {line.split()[0]: line.split(":", 1)[1].split()
               for line in out.splitlines() if "median of each instance" in line}
    assert {side: len(values) for side, values in medians.items()} == {"offline": 2,
                                                                      "server": 2}
    assert "median of instance medians" in out and "(2 instances)" in out


def test_a_failed_offline_worker_is_reported_not_waited_on(tmp_path: Path) -> None:
    from benchmarks.server_path_offline import OfflineSide

    with pytest.raises(RuntimeError, match=r"offline worker .* ended"):
        OfflineSide(tmp_path / "no-such-model", 1, 4, "float32", instance=0)
