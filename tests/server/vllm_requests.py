"""The requests whose responses kvserve must shape as vLLM does (routes, fields, types).

`tests/data/vllm_responses/record.py` sent them once to vLLM's CPU build and committed the
answers; `test_vllm_shapes.py` sends them to kvserve and compares the two field by field.
Both serve the same tiny random checkpoint (`write_checkpoint`) under the same name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvserve.model import write_random_checkpoint
from tests.model.arch_configs import base_config

MODEL = "tiny"
PROMPT = "The quick brown fox jumps over"


def write_checkpoint(path: Path) -> Path:
    """The tiny random Llama both servers run: head_dim 32 (vLLM's CPU attention has no 16)."""
    return write_random_checkpoint(path, base_config(hidden_size=128, num_attention_heads=4,
                                                     num_key_value_heads=2), seed=7)


def launch_line(model_dir: Path, chat_template: Path) -> list[str]:
    """A vLLM manifest's `serve` arguments (after `vllm serve`, before --host/--port): what
    record.py started vLLM with and the tests start kvserve with, unchanged. The KV cache is
    sized by --kv-cache-memory-bytes, which overrides --gpu-memory-utilization in both (a
    test must not reserve a share of the machine's RAM)."""
    return [str(model_dir), "--served-model-name", MODEL, "--dtype", "float32",
            "--max-model-len", "256", "--gpu-memory-utilization", "0.3",
            "--kv-cache-memory-bytes", str(64 << 20),
            "--tensor-parallel-size", "1", "--enable-prefix-caching", "--kv-cache-dtype", "auto",
            "--chat-template", str(chat_template), "--uvicorn-log-level", "warning",
            "--trust-remote-code", "--enforce-eager", "--disable-log-stats",
            "--max-num-seqs", "8", "--seed", "0"]


def write_chat_template(model_dir: Path, path: Path) -> Path:
    """The model's own chat template as a file, for --chat-template."""
    import json

    config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    path.write_text(config["chat_template"], encoding="utf-8")
    return path


@dataclass(frozen=True, slots=True)
class Case:
    """One request: `name` is the recording's file stem; `stream` reads SSE chunks."""

    name: str
    method: str
    path: str
    body: dict[str, Any] | None = None
    stream: bool = False
    headers: dict[str, str] = field(default_factory=dict)


CASES: tuple[Case, ...] = (
    Case("models", "GET", "/v1/models"),
    Case("version", "GET", "/version"),
    Case("ping_get", "GET", "/ping"),
    Case("ping_post", "POST", "/ping"),
    Case("tokenize_prompt", "POST", "/tokenize", {"model": MODEL, "prompt": PROMPT}),
    Case("tokenize_no_specials", "POST", "/tokenize",
         {"model": MODEL, "prompt": PROMPT, "add_special_tokens": False}),
    Case("tokenize_messages", "POST", "/tokenize",
         {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}]}),
    Case("tokenize_token_strs", "POST", "/tokenize",
         {"model": MODEL, "prompt": PROMPT, "return_token_strs": True}),
    Case("detokenize", "POST", "/detokenize", {"model": MODEL, "tokens": [40, 41, 42, 43]}),
    Case("completion", "POST", "/v1/completions",
         {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0}),
    Case("completion_stop", "POST", "/v1/completions",
         {"model": MODEL, "prompt": PROMPT, "max_tokens": 30, "temperature": 0,
          "ignore_eos": True, "stop": ["p"]}),
    Case("completion_logprobs", "POST", "/v1/completions",
         {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 2}),
    Case("completion_echo", "POST", "/v1/completions",
         {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True}),
    Case("completion_echo_logprobs", "POST", "/v1/completions",
         {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True,
          "logprobs": 2}),
    Case("completion_echo_loglikelihood", "POST", "/v1/completions",
         {"model": MODEL, "prompt": PROMPT, "max_tokens": 0, "temperature": 0, "echo": True,
          "logprobs": 1}),
    Case("completion_stream", "POST", "/v1/completions",
         {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True,
          "stream_options": {"include_usage": True}}, stream=True),
    Case("chat", "POST", "/v1/chat/completions",
         {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}],
          "max_tokens": 5, "temperature": 0}),
)


def send(client: httpx.Client, case: Case) -> dict[str, Any]:
    """The response as recorded: status, content type, and the JSON body (or SSE chunks)."""
    response = client.request(case.method, case.path, json=case.body, headers=case.headers)
    out: dict[str, Any] = {"status": response.status_code,
                           "content_type": response.headers.get("content-type", "")}
    if case.stream:
        out["chunks"] = [_json(line[6:]) for line in response.text.splitlines()
                         if line.startswith("data: ")]
    elif response.content:
        out["body"] = _json(response.text)
    else:
        out["body"] = None
    return out


def _json(text: str) -> Any:
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text
