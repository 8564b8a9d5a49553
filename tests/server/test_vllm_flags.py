"""`kvserve serve` takes vLLM's launch flags: with vLLM's meaning, as already true, or refused
with a message naming the flag (never ignored)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.cli import build_parser
from kvserve.runtime import EngineArgs
from kvserve.server.command import engine_args_from
from kvserve.server.vllm.flags import resolve_model


def parse(*argv: str):  # type: ignore[no-untyped-def]
    args = build_parser().parse_args(["serve", *argv])
    resolve_model(args)
    return args


def test_positional_model_and_vllm_meanings() -> None:
    args = parse("org/model", "--gpu-memory-utilization", "0.3", "-tp", "1",
                 "--enable-prefix-caching", "--kv-cache-dtype", "fp32", "--dtype", "half",
                 "--chat-template", "{{ messages }}", "--disable-log-requests",
                 "--uvicorn-log-level", "info", "--trust-remote-code", "--enforce-eager",
                 "--disable-log-stats", "--enable-chunked-prefill", "--pipeline-parallel-size",
                 "1", "--load-format", "safetensors", "--revision", "main")
    engine = engine_args_from(args)
    assert engine.model == "org/model"
    assert engine.gpu_memory_utilization == 0.3
    assert engine.enable_prefix_caching and engine.kv_cache_dtype == "fp32"
    assert engine.dtype == "float16" and engine.chat_template == "{{ messages }}"
    assert engine.revision == "main" and engine.tensor_parallel_size == 1
    assert args.uvicorn_log_level == "info" and not args.enable_log_requests
    assert not parse("m", "--no-enable-prefix-caching").enable_prefix_caching
    assert parse("--model", "m").model == "m"
    assert parse("--dtype", "auto").dtype == "auto"
    assert engine_args_from(parse("--dtype", "auto")).dtype is None


def test_tokenizer_and_hf_config_path_overrides_reach_the_engine() -> None:
    engine = engine_args_from(parse("m.gguf", "--tokenizer", "org/tok", "--hf-config-path",
                                    "/cfg", "--load-format", "gguf"))
    assert engine.model == "m.gguf"
    assert (engine.tokenizer, engine.hf_config_path) == ("org/tok", "/cfg")
    assert engine_args_from(parse("m")).tokenizer is None


def test_quantization_keeps_a_supported_method_and_nothing_else() -> None:
    assert parse("m").quantization is None
    assert parse("m", "--quantization", "gguf").quantization == "gguf"
    assert parse("m", "-q", "q4_1").quantization == "q4_1"


def test_the_model_given_twice_differently_is_an_error() -> None:
    with pytest.raises(ValueError, match="given twice"):
        parse("a", "--model", "b")
    assert parse("a", "--model", "a").model == "a"


@pytest.mark.parametrize(("argv", "named"), [
    (["--quantization", "awq"], "--quantization awq"),
    (["-q", "gptq"], "-q gptq"),
    (["-q", "fp8"], "-q fp8"),
    (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill"),
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2"),
    (["--data-parallel-size", "4"], "--data-parallel-size 4"),
    (["--load-format", "pt"], "--load-format pt"),
    (["--ssl-keyfile", "k.pem"], "--ssl-keyfile k.pem"),
])
def test_flags_kvserve_cannot_honour_are_refused_by_name(
        argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse("m", *argv)
    assert exc.value.code == 2
    assert f"{named}: " in capsys.readouterr().err


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tensor_parallel_size": 2, "kv_host_tier_bytes": 1 << 20}, "tensor parallelism"),
    ({"kv_cache_dtype": "fp8"}, "--kv-cache-dtype fp8"),
    ({"kv_cache_dtype": "int3"}, "--kv-cache-dtype must be"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in"),
    ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization must be in"),
])
def test_engine_values_kvserve_cannot_honour_are_errors(kwargs: dict[str, object],
                                                        message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)  # type: ignore[arg-type]


def test_serve_says_why_it_cannot_start(checkpoint: Path) -> None:
    """A launch line kvserve cannot honour exits at once saying why (no model is loaded)."""
    done = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", str(checkpoint),
                           "--kv-cache-dtype", "fp8"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert "--kv-cache-dtype fp8" in done.stderr.replace("\n", " ")
