"""`python -m benchmarks server-path` on a GGUF file: both sides keep its blocks packed."""

from __future__ import annotations

import json

import pytest
from gguf import GGMLQuantizationType as T

from benchmarks.__main__ import main
from benchmarks.server_path_cli import _quantization_args
from benchmarks.server_path_offline import quantization
from tests.model.gguf.conftest import GGUFFactory


def test_a_gguf_runs_on_both_sides_with_its_blocks_packed(
        make_gguf: GGUFFactory, capsys: pytest.CaptureFixture[str]) -> None:
    path = make_gguf(T.Q8_0, max_position_embeddings=4096)  # the bench asks for 4,096
    assert quantization(path) == "gguf" and _quantization_args(path) == ["--quantization", "gguf"]
    code = main(["server-path", "--model", str(path), "--num-prompts", "1", "--input-len", "16",
                 "--output-len", "4", "--repeats", "1", "--threads", "1"])
    assert code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()
            if line.startswith("{")]
    assert [(r["side"], r["tokens"]) for r in rows] == [("offline", 3), ("server", 3)]
