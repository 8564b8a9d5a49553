"""`kvserve bench serve` against a real `kvserve serve` process on a free port (no peer needed)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from kvserve.bench.serve_load import percentile
from kvserve.bench.serve_prompts import PromptBuilder, PromptSpec, prompt_lengths
from kvserve.bench.server_launch import KVSERVE, LaunchedServer, LaunchSpec, free_port
from kvserve.cli import main
from kvserve.model import Tokenizer, write_random_checkpoint
from tests.bench.tiny_model import TINY


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("serve-bench") / "tiny", TINY, seed=5)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedServer]:
    spec = LaunchSpec(model_dir=model_dir, served_model_name="tiny-test", kv_cache_bytes=1 << 22,
                      max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256,
                      num_threads=1)
    with LaunchedServer(KVSERVE, spec, tmp_path_factory.mktemp("logs"), 60.0) as srv:
        yield srv


def test_percentile_is_linear_between_ranks():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([float(i) for i in range(1, 101)], 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_prompts_have_the_exact_length_and_share_the_prefix(model_dir):
    builder = PromptBuilder(Tokenizer.from_pretrained(model_dir))
    spec = PromptSpec(num_prompts=6, input_len=40, prefix_fraction=0.5)
    prompts = builder.build(spec, "s")
    assert prompt_lengths(builder, prompts) == [40] * 6
    assert builder.build(spec, "s") == prompts and builder.build(spec, "t") != prompts
    prefix_tokens = Tokenizer.from_pretrained(model_dir).encode(prompts[0])[:20]
    assert all(Tokenizer.from_pretrained(model_dir).encode(p)[:20] == prefix_tokens
               for p in prompts)


def test_load_generator_against_kvserve_serve(server, model_dir, capsys):
    code = main(["bench", "serve", server.url, "--model", str(model_dir), "--concurrency", "1",
                 "3", "--num-prompts", "5", "--input-len", "24", "--output-len", "6",
                 "--prefix-fraction", "0.5", "--json"])
    assert code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["concurrency"] for r in rows] == [1, 3]
    for r in rows:
        assert r["server"] == server.url and "skipped" not in r
        assert r["num_requests"] == r["completed"] == 5 and r["failed"] == 0, r["errors"]
        assert r["output_tokens"] == 5 * 6 and r["prompt_tokens"] == 5 * 24
        assert (r["input_len"], r["output_len"], r["prefix_len"]) == (24, 6, 12)
        assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"]
        assert 0 < r["content_chunks"] <= r["output_tokens"]
        assert r["output_throughput"] == pytest.approx(r["output_tokens"] / r["duration_s"])
        assert r["request_throughput"] == pytest.approx(5 / r["duration_s"])
        assert set(r["itl_ms"]) == {"mean", "p50", "p99"} and "mean" in r["tpot_ms"]


def test_a_sampled_run_sends_its_temperature_and_top_p_and_still_gets_every_token(
        server, model_dir, capsys):
    code = main(["bench", "serve", server.url, "--model", str(model_dir), "--concurrency", "2",
                 "--num-prompts", "3", "--input-len", "16", "--output-len", "5",
                 "--temperature", "0.8", "--top-p", "0.9", "--json"])
    assert code == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert (row["temperature"], row["top_p"]) == (0.8, 0.9)
    assert row["completed"] == 3 and row["output_tokens"] == 3 * 5  # EOS ignored when sampled


@pytest.mark.parametrize("flags", [["--top-p", "0"], ["--top-p", "1.5"], ["--temperature", "-1"]])
def test_bad_sampling_flags_are_refused_before_anything_runs(model_dir, flags, capsys):
    code = main(["bench", "serve", "http://127.0.0.1:9", "--model", str(model_dir), *flags])
    assert code == 2
    assert "--temperature must be at least 0 and --top-p in (0, 1]" in capsys.readouterr().err


def test_absent_or_unreachable_servers_are_skipped_not_fatal(model_dir, monkeypatch, capsys):
    monkeypatch.setenv("KVSERVE_VLLM_PYTHON", "/nonexistent/python")
    dead = f"http://127.0.0.1:{free_port()}"
    code = main(["bench", "serve", dead, "--launch", "vllm", "--model", str(model_dir),
                 "--concurrency", "2", "--num-prompts", "2", "--input-len", "8",
                 "--output-len", "2", "--json"])
    assert code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [(r["server"], r["concurrency"]) for r in rows] == [(dead, 2), ("vllm", 2)]
    assert "ConnectError" in rows[0]["skipped"]
    assert "vLLM is not installed" in rows[1]["skipped"]


def test_llamacpp_is_given_the_gguf_file_and_skipped_without_one(tmp_path, monkeypatch):
    from kvserve.bench.server_launch import LLAMACPP, LaunchError, LaunchSpec, server_command

    python = tmp_path / "python"
    python.touch()
    monkeypatch.setenv("KVSERVE_LLAMACPP_PYTHON", str(python))
    spec = LaunchSpec(model_dir=tmp_path, served_model_name="m", kv_cache_bytes=1 << 20,
                      max_model_len=512, max_num_seqs=4, max_num_batched_tokens=256,
                      num_threads=2)
    with pytest.raises(LaunchError, match="--gguf FILE"):
        server_command(LLAMACPP, spec, 8000)
    gguf = tmp_path / "m.gguf"
    cmd, _ = server_command(LLAMACPP, replace(spec, gguf_file=gguf), 8000)
    assert cmd[:3] == [str(python), "-m", "llama_cpp.server"]
    assert cmd[cmd.index("--model") + 1] == str(gguf)
    assert cmd[cmd.index("--n_ctx") + 1] == "512" and cmd[cmd.index("--n_threads") + 1] == "2"
    monkeypatch.setenv("KVSERVE_LLAMACPP_PYTHON", str(tmp_path / "absent"))
    with pytest.raises(LaunchError, match=r"llama\.cpp's server is not installed"):
        server_command(LLAMACPP, replace(spec, gguf_file=gguf), 8000)
