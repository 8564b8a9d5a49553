"""`python -m benchmarks structured`: what a JSON-schema constraint costs per output token, on
kvserve and on vLLM (when installed), same model, same prompt, same schema.

Each server is started with the same LaunchSpec; per mode (`free`: unconstrained, EOS ignored;
`json`: `structured_outputs.json` with `benchmarks.grammar_cli.SCHEMA`) one warm-up request,
then sequential streamed completions. The time per output token is (last token - first token) /
(tokens - 1) from the stream; the report gives each mode's median, the constrained mode's extra
time per token, and the first constrained request's time to first token (grammar compile).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.grammar_cli import SCHEMA
from kvserve.bench.server_launch import SERVERS, LaunchedServer, LaunchError, LaunchSpec

PROMPT = "Write the customer's order as JSON:"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("structured", help="structured-output overhead per token, vs vLLM")
    p.add_argument("--model", required=True, help="model directory (both servers load it)")
    p.add_argument("--servers", default=",".join(SERVERS), help="comma-separated: kvserve,vllm")
    p.add_argument("--requests", type=int, default=8, help="measured requests per mode")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--vllm-eager", action="store_true",
                   help="start vLLM with --enforce-eager (no compile warm-up: starts in time on "
                        "a loaded machine)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds per server")
    p.add_argument("--json", action="store_true", help="one JSON object per server")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    spec = LaunchSpec(Path(args.model), "bench-model", kv_cache_bytes=256 << 20,
                      max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=1024,
                      num_threads=args.threads, vllm_eager=args.vllm_eager)
    log_dir = Path(tempfile.mkdtemp(prefix="kvserve-bench-structured-"))
    for name in args.servers.split(","):
        try:
            with LaunchedServer(name, spec, log_dir, args.startup_timeout) as server:
                row = measure(server.url, spec.served_model_name, args.requests,
                              args.max_tokens) | {"server": name}
        except LaunchError as exc:
            print(f"{name}: skipped ({exc})")
            continue
        if args.json:
            print(json.dumps(row))
        else:
            print(f"{name:<8} free {row['free_ms_per_token']:7.2f} ms/token  json "
                  f"{row['json_ms_per_token']:7.2f} ms/token  overhead "
                  f"{row['overhead_ms_per_token']:+6.2f} ms/token "
                  f"({row['overhead_pct']:+.1f}%)  first json TTFT {row['first_json_ttft_ms']:.0f} "
                  f"ms  json answers: {row['json_tokens']} tokens, {row['json_valid']} of "
                  f"{row['json_stopped']} that stopped parse")
    return 0


def measure(url: str, model: str, num_requests: int, max_tokens: int) -> dict[str, Any]:
    """Both modes against one server (see the module docstring)."""
    free: dict[str, Any] = {"ignore_eos": True}
    shaped: dict[str, Any] = {"structured_outputs": {"json": SCHEMA}}
    with httpx.Client(base_url=url, timeout=300.0) as client:
        _stream(client, model, max_tokens, free)  # warm-up
        first = _stream(client, model, max_tokens, shaped)  # compiles the grammar
        free_runs = [_stream(client, model, max_tokens, free) for _ in range(num_requests)]
        json_runs = [_stream(client, model, max_tokens, shaped) for _ in range(num_requests)]
    free_tpot = statistics.median(r["tpot_s"] for r in free_runs) * 1e3
    json_tpot = statistics.median(r["tpot_s"] for r in json_runs) * 1e3
    stopped = [r for r in json_runs if r["finish_reason"] == "stop"]
    return {"free_ms_per_token": free_tpot, "json_ms_per_token": json_tpot,
            "overhead_ms_per_token": json_tpot - free_tpot,
            "overhead_pct": 100 * (json_tpot - free_tpot) / free_tpot,
            "first_json_ttft_ms": first["ttft_s"] * 1e3,
            "json_tokens": sum(r["tokens"] for r in json_runs),
            "json_stopped": len(stopped), "json_valid": sum(_parses(r["text"]) for r in stopped)}


def _stream(client: httpx.Client, model: str, max_tokens: int,
            extra: dict[str, Any]) -> dict[str, Any]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}} | extra
    start = time.perf_counter()
    stamps: list[float] = []
    text, reason, tokens = "", None, 0
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                stamps.append(time.perf_counter())
                text += choice.get("text", "")
                reason = choice.get("finish_reason") or reason
    tpot = (stamps[-1] - stamps[0]) / max(tokens - 1, 1) if stamps else 0.0
    return {"ttft_s": stamps[0] - start if stamps else 0.0, "tpot_s": tpot, "tokens": tokens,
            "text": text, "finish_reason": reason}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
