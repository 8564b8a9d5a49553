"""`kvserve bench serve`: online latency and throughput of OpenAI-compatible servers, side by side.

Benchmarks servers already running (URL arguments) and/or servers it launches itself
(`--launch kvserve,vllm`, each entry NAME[:MODE], e.g. `kvserve:q4_1`: launch_target.py), one at a
time: launch, wait for /health, measure every concurrency, stop, then the next, so two servers
never share the CPU. Every server gets the same prompts. While a launched server is measured,
the resident memory of its process tree is sampled (proc_memory.py): after start and peak.
Per concurrency: untimed warm-up requests (other prompts, same concurrency), then the timed
closed-loop run of `--num-prompts` requests; each concurrency level has its own prompts, so no
level hits the prefix cache warmed by another. What is timed: serve_load.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from kvserve.bench.launch_target import CHOICES, LaunchTarget, parse_launch
from kvserve.bench.proc_memory import TreeRssSampler
from kvserve.bench.serve_load import LevelSummary, completion_body, run_closed_loop
from kvserve.bench.serve_prompts import PromptBuilder, PromptSpec
from kvserve.bench.serve_report import ServerRun, json_rows, print_table, rss_text
from kvserve.bench.server_launch import LaunchedServer, LaunchError, LaunchSpec

WARMUP_MAX_TOKENS = 16


class ServerFailed(Exception):
    """The server answered, but not usefully (e.g. every warm-up request failed)."""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="online TTFT, ITL and throughput of OpenAI servers")
    p.add_argument("urls", nargs="*", metavar="URL", help="base URL of a running server")
    p.add_argument("--launch", default="", metavar="NAME[:MODE],...",
                   help=f"servers to launch one after another, each NAME[:MODE]: {CHOICES}. "
                        "Modes: float32 (the default), bfloat16, q8_0/q4_1 (the float32 "
                        "weights packed at load), gguf (kvserve serves the --gguf file's own "
                        "blocks), w8a8 (kvserve: bf16 with int8 x int8 projections); a name may "
                        "repeat with other modes")
    p.add_argument("--model", default="tiny",
                   help="tiny, 100m (random weights, cached) or a checkpoint dir: the model "
                        "launched, and the tokenizer prompts are built with")
    p.add_argument("--served-model-name", default=None,
                   help="model name sent to URL servers (default: their /v1/models)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], metavar="C")
    p.add_argument("--num-prompts", type=int, default=64, help="timed requests per concurrency")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (BOS included)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (EOS ignored)")
    p.add_argument("--prefix-fraction", type=float, default=0.0,
                   help="share of each prompt that is a prefix common to the level's prompts")
    p.add_argument("--num-warmup", type=int, default=2,
                   help="warm-up requests per level (at least the concurrency)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt text")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request's temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="every request's top_p")
    g = p.add_argument_group("launched servers (same values for each)")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    g.add_argument("--max-model-len", type=int, default=4096)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--threads", type=int, default=2, help="compute threads per server")
    g.add_argument("--vllm-eager", action="store_true", help="start vLLM with --enforce-eager")
    g.add_argument("--gguf", type=Path, default=None, metavar="FILE",
                   help="the same model as a GGUF file, for llama.cpp's server and kvserve:gguf")
    g.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to /health")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", action="store_true", help="one JSON object per server x concurrency")
    p.set_defaults(func=run)


def sampling_label(temperature: float, top_p: float) -> str:
    if temperature == 0:
        return "greedy"
    return f"temperature {temperature:g}" + (f", top_p {top_p:g}" if top_p < 1 else "")


def served_model(url: str, explicit: str | None) -> str:
    """`explicit`, else the first model the server lists at /v1/models."""
    if explicit:
        return explicit
    resp = httpx.get(f"{url}/v1/models", timeout=30.0)
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


class Workload:
    """Every level's prompts, built once and sent identically to every server."""

    def __init__(self, builder: PromptBuilder, args: argparse.Namespace) -> None:
        self.spec = PromptSpec(args.num_prompts, args.input_len, args.prefix_fraction)
        self.output_len = args.output_len
        self.temperature, self.top_p = args.temperature, args.top_p
        self.timed: dict[int, list[str]] = {}
        self.warmup: dict[int, list[str]] = {}
        for c in args.concurrency:
            self.timed[c] = builder.build(self.spec, f"{args.seed}/c{c}")
            warm = PromptSpec(max(args.num_warmup, c), args.input_len, args.prefix_fraction)
            self.warmup[c] = builder.build(warm, f"{args.seed}/c{c}/warmup")

    def describe(self) -> dict[str, Any]:
        return {"num_prompts": self.spec.num_prompts, "input_len": self.spec.input_len,
                "output_len": self.output_len, "prefix_len": self.spec.prefix_len,
                "temperature": self.temperature, "top_p": self.top_p}

    def body(self, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
        return completion_body(model, prompt, max_tokens, self.temperature, self.top_p)


def measure(run: ServerRun, model: str, workload: Workload, args: argparse.Namespace,
            err: Console) -> None:
    """Warm up and time every concurrency level against `run.url`, filling `run.levels`."""
    assert run.url is not None
    for c in args.concurrency:
        warm = [workload.body(model, p, min(args.output_len, WARMUP_MAX_TOKENS))
                for p in workload.warmup[c]]
        records, _ = asyncio.run(run_closed_loop(run.url, warm, c, args.request_timeout))
        failed = [r.error for r in records if r.error]
        if len(failed) == len(records):
            raise ServerFailed(f"c={c}: every warm-up request failed ({failed[0]}); the levels "
                               "before it stand")
        bodies = [workload.body(model, p, args.output_len) for p in workload.timed[c]]
        records, seconds = asyncio.run(run_closed_loop(run.url, bodies, c, args.request_timeout))
        level = LevelSummary.from_records(c, records, seconds)
        run.levels.append(level)
        err.print(f"[dim]{run.label} c={c}: {level.completed}/{level.num_requests} ok, "
                  f"{level.output_throughput:,.0f} out tok/s, TTFT p50 "
                  f"{level.ttft_ms['p50']:,.1f} ms[/]", highlight=False)


def bench_url(url: str, workload: Workload, args: argparse.Namespace, err: Console) -> ServerRun:
    run = ServerRun(label=url, url=url.rstrip("/"))
    try:
        measure(run, served_model(run.url or url, args.served_model_name), workload, args, err)
    except (httpx.HTTPError, ServerFailed, KeyError, IndexError, ValueError) as exc:
        run.skipped = f"{type(exc).__name__}: {exc}"  # the levels measured before it stand
    return run


def bench_launched(target: LaunchTarget, spec: LaunchSpec, workload: Workload,
                   args: argparse.Namespace, log_dir: Path, err: Console) -> ServerRun:
    """Launch `target`, measure every level with its process tree's RSS sampled from health to
    the last level (`run.info`: startup_s, start_rss_mib, peak_rss_mib), stop it; a launch or
    server failure marks the run skipped, keeping the levels measured before it."""
    name = target.label
    run = ServerRun(label=name)
    server = LaunchedServer(target, spec, log_dir, args.startup_timeout)
    err.print(f"[dim]{name}: starting on {server.url} …[/]", highlight=False)
    try:
        with server:
            run.url = server.url
            run.info = {"startup_s": round(server.startup_s, 1)}
            err.print(f"[dim]{name}: healthy after {server.startup_s:.0f} s[/]")
            assert server.pid is not None  # started
            rss = TreeRssSampler(server.pid)
            try:
                with rss:
                    measure(run, spec.served_model_name, workload, args, err)
            finally:  # the peak so far also holds for a server that failed part way
                run.info |= rss.mib()
            err.print(f"[dim]{name}: {rss_text(run)}[/]", highlight=False)
    except (LaunchError, ServerFailed, httpx.HTTPError) as exc:
        run.skipped = str(exc)  # the levels measured before it stand
        tail = server.log_tail()
        err.print(f"[yellow]{name}: skipped: {exc}[/]" + (f"\n{tail}" if tail else ""),
                  soft_wrap=True, highlight=False)
    return run


def run(args: argparse.Namespace) -> int:
    err = Console(stderr=True)
    try:
        launches = parse_launch(args.launch)
        if not args.urls and not launches:
            raise ValueError("give the URL of a running server, or --launch kvserve,vllm")
        if min(args.concurrency) < 1 or args.output_len < 1 or args.threads < 1:
            raise ValueError("--concurrency, --output-len and --threads must be at least 1")
        if args.temperature < 0 or not 0 < args.top_p <= 1:
            raise ValueError("--temperature must be at least 0 and --top-p in (0, 1]")
        needs_gguf = [t.label for t in launches if t.reads_gguf]
        if needs_gguf and args.gguf is None:
            raise ValueError(f"--launch {','.join(needs_gguf)} reads a GGUF file: pass --gguf "
                             "FILE (the same model as a .gguf)")
        if launches and args.input_len + args.output_len > args.max_model_len:
            raise ValueError(f"--input-len + --output-len exceeds --max-model-len "
                             f"{args.max_model_len}")
        PromptSpec(args.num_prompts, args.input_len, args.prefix_fraction).check()
        from kvserve.bench.engine_workloads import ensure_bench_model
        from kvserve.model import Tokenizer

        model_dir = ensure_bench_model(args.model)
        workload = Workload(PromptBuilder(Tokenizer.from_pretrained(model_dir)), args)
    except (ValueError, OSError) as exc:
        err.print(f"[red]{exc}[/]", soft_wrap=True)
        return 2
    args.concurrency = list(dict.fromkeys(args.concurrency))
    spec = LaunchSpec(model_dir=model_dir.resolve(), served_model_name=model_dir.name,
                      kv_cache_bytes=args.kv_cache_memory_bytes,
                      max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      num_threads=args.threads, vllm_eager=args.vllm_eager,
                      gguf_file=None if args.gguf is None else args.gguf.resolve())
    runs = [bench_url(u, workload, args, err) for u in args.urls]
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-serve-") as tmp:
        runs += [bench_launched(t, spec, workload, args, Path(tmp), err) for t in launches]
    if args.json:
        for row in json_rows(runs, args.concurrency, workload.describe()):
            print(json.dumps(row), flush=True)
    else:
        w = workload.describe()
        print_table(runs, args.concurrency,
                    f"serving: {args.model}, {w['num_prompts']} prompts x {w['input_len']} in "
                    f"(shared prefix {w['prefix_len']}) / {w['output_len']} out, "
                    f"{sampling_label(args.temperature, args.top_p)}; "
                    f"launched: {args.threads} threads, "
                    f"{args.kv_cache_memory_bytes / 2**30:g} GiB KV, float32 unless NAME:MODE")
    return 0
