"""`kvserve bench engine`: offline throughput, TTFT and peak memory of kvserve's engine, side by
side with vLLM's CPU build, llama.cpp and transformers' batched `generate`, on the same token ids,
in the same run.

All systems: greedy, EOS ignored, exactly `max_tokens` per request, the same thread count, prefix
caching on where the system has it, the same KV cache budget (kvserve and vLLM). Precision: kvserve
in each `--precision` mode, vLLM in each `--vllm-dtype`, HF float32, llama.cpp the `--gguf` file's
own types. What each system times is stated in engine_systems.py and the repository's
benchmarks/peers/*_engine_driver.py; peak RSS (`peak_rss_mib`) is the bench process's own peak
from just before an in-process system loads (peak_rss.py), a peer driver's processes' peak.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from kvserve.bench.engine_peers import (
    LLAMACPP_DRIVER,
    VLLM_DRIVER,
    VLLM_DTYPES,
    kv_cache_bytes,
    run_llamacpp,
    run_vllm,
    vllm_system,
)
from kvserve.bench.engine_report import Cell, print_table
from kvserve.bench.engine_systems import (
    HF,
    KVSERVE,
    LLAMACPP,
    PRECISIONS,
    VLLM,
    RunResult,
    kvserve_system,
)
from kvserve.bench.engine_workloads import (
    MODEL_NAMES,
    WORKLOADS,
    Workload,
    WorkloadSizes,
    build_workload,
    ensure_bench_model,
)
from kvserve.bench.machine import MachineLimits, format_limits, fraction_of_limit, measure
from kvserve.bench.peak_rss import reset_peak_rss, status_mib
from kvserve.bench.peers_env import llamacpp_unavailable, vllm_unavailable
from kvserve.bench.plots import ENGINE_PNG, PlotsUnavailable, engine_plot, require_plots

PEERS = (VLLM, LLAMACPP, HF)
NO_GGUF = ("pass --gguf FILE, the same model as one GGUF file (llama.cpp cannot read the "
           "checkpoint directory)")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("engine", help="offline engine throughput and TTFT vs vLLM, llama.cpp "
                       "and HF")
    p.add_argument("--model", nargs="+", default=list(MODEL_NAMES), metavar="M",
                   help=f"{', '.join(MODEL_NAMES)} (random weights, cached) or a checkpoint dir")
    p.add_argument("--workload", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--precision", nargs="+", default=["float32"], choices=PRECISIONS,
                   help="kvserve's modes, each a system (q*: projections kept in that GGUF "
                   "type, lm_head q8_0; w8a8: bf16 with int8 x int8 projections); the first "
                   "is the reference the others' parity is to")
    p.add_argument("--machine-limits", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the GEMM rates and memory bandwidth first (kvserve bench "
                   "machine) and report kvserve's figures as shares of them (default on)")
    p.add_argument("--peer", nargs="+", default=["auto"], choices=["auto", *PEERS, "none"],
                   help="peers to measure alongside (auto: every installed peer; llama.cpp "
                   "only with --gguf)")
    p.add_argument("--vllm-dtype", nargs="+", default=["float32"], choices=VLLM_DTYPES,
                   help="vLLM's dtypes, one run of its driver each (systems vllm and "
                   "vllm:bfloat16)")
    p.add_argument("--gguf", type=Path, default=None, metavar="FILE",
                   help="the --model as one GGUF file, for llama.cpp (which runs its own weight "
                   "types; greedy parity is reported, not expected)")
    d = WorkloadSizes()
    p.add_argument("--num-prompts", type=int, default=d.num_prompts, help="requests per batch")
    p.add_argument("--prompt-len", type=int, default=d.prompt_len, help="decode-heavy prompt")
    p.add_argument("--output-len", type=int, default=d.output_len, help="decode-heavy output")
    p.add_argument("--prefix-len", type=int, default=d.prefix_len, help="shared-prefix prefix")
    p.add_argument("--suffix-len", type=int, default=d.suffix_len, help="shared-prefix suffix")
    p.add_argument("--prefix-output-len", type=int, default=d.prefix_output_len,
                   help="shared-prefix output")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the prompt token ids")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs per system and workload (cold prefix cache each); best kept")
    p.add_argument("--threads", type=int, default=2, help="torch/OpenMP threads per system")
    p.add_argument("--kv-cache-gib", type=float, default=2,
                   help="KV cache of kvserve and vLLM in GiB (whole GiB: vLLM gets it through "
                   "VLLM_CPU_KVCACHE_SPACE, else through kv_cache_memory_bytes)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--vllm-eager", action=argparse.BooleanOptionalAction, default=True,
                   help="run vLLM with enforce_eager (no torch.compile; default on)")
    p.add_argument("--vllm-omp-bind", default=None, metavar="CPUS",
                   help="VLLM_CPU_OMP_THREADS_BIND (default: --threads cores, 0-(N-1); 'auto' is "
                   "vLLM's own layout: one core kept for its engine-core process)")
    p.add_argument("--peer-timeout", "--vllm-timeout", dest="peer_timeout", type=float,
                   default=1800.0, help="seconds per peer driver run (each vLLM dtype, "
                   "llama.cpp)")
    p.add_argument("--json", action="store_true", help="one JSON object per model x workload")
    p.add_argument("--json-out", type=Path, default=None, metavar="FILE",
                   help="also write the JSON objects (one a line) to FILE")
    p.add_argument("--plot", type=Path, default=None, metavar="DIR",
                   help=f"write {ENGINE_PNG} (tokens/s of every system) into DIR")
    p.set_defaults(func=run)


def chosen_peers(requested: list[str], gguf: Path | None = None) -> dict[str, str | None]:
    """Peer name -> None (measure it) or the reason it is skipped. ValueError for llama.cpp asked
    for by name without a `gguf` file (under "auto" that only skips it)."""
    if "none" in requested:
        return {}
    auto = "auto" in requested
    peers: dict[str, str | None] = {}
    if auto or VLLM in requested:
        peers[VLLM] = vllm_unavailable(VLLM_DRIVER)
    if LLAMACPP in requested and gguf is None:
        raise ValueError(f"--peer {LLAMACPP}: {NO_GGUF}")
    if LLAMACPP in requested or (auto and llamacpp_unavailable(LLAMACPP_DRIVER) is None):
        peers[LLAMACPP] = llamacpp_unavailable(LLAMACPP_DRIVER) or (
            None if gguf is not None else NO_GGUF)
    if auto or HF in requested:
        try:
            import transformers  # noqa: F401
            peers[HF] = None
        except ImportError as exc:
            peers[HF] = f"transformers is not importable here ({exc}); pip install transformers"
    return peers


def run_in_process(system: str, model_dir: Path, workloads: list[Workload],
                   args: argparse.Namespace, err: Console,
                   precision: str = "float32") -> list[RunResult]:
    """kvserve (in `precision`) or HF on every workload of a model; a failing peer becomes
    skipped runs. Each run's `peak_rss_mib`: this process's peak resident set from just before
    the load to the end of that workload (None where it cannot be reset and read)."""
    from kvserve.bench.engine_systems import HFRunner, KVServeRunner

    gc.collect()
    is_reset = reset_peak_rss()
    rss_before = status_mib("VmRSS")
    try:
        if system.startswith(KVSERVE):
            runner: Any = KVServeRunner(str(model_dir), kv_cache_bytes(args), args.threads,
                                        args.max_model_len, precision, system)
        else:
            runner = HFRunner(str(model_dir), args.threads)
    except Exception as exc:
        if system.startswith(KVSERVE):
            raise
        err.print(f"[yellow]{system} failed to load: {exc}[/]", soft_wrap=True)
        return [RunResult(system, skipped=f"load failed: {exc}") for _ in workloads]
    runs = []
    try:
        for w in workloads:
            try:
                result = runner.run(w, args.repeats)
                result.peak_rss_mib = status_mib("VmHWM") if is_reset else None
                result.info["rss_before_load_mib"] = rss_before
                runs.append(result)
            except Exception as exc:
                if system.startswith(KVSERVE):
                    raise
                runs.append(RunResult(system, skipped=f"failed: {type(exc).__name__}: {exc}"))
    finally:
        runner.close()
    return runs


def add_limit_shares(model_dir: Path, precision: str, workloads: list[Workload],
                     runs: list[RunResult], limits: MachineLimits) -> None:
    """Record in each run's info its shares of the machine's limits (machine.fraction_of_limit;
    concurrency: the workload's requests, all submitted at once). A bfloat16 run the CPU fell
    back to float32 on (no bf16 instructions) is held to float32's bytes and GEMM rate."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    for w, run in zip(workloads, runs, strict=True):
        if run.skipped is not None or not run.seconds:
            continue
        mode = "float32" if run.info.get("ran_dtype") == "float32" and precision == "bfloat16" \
            else precision
        out_per_s = run.num_output_tokens / run.seconds
        all_per_s = (run.num_output_tokens + w.num_prompt_tokens) / run.seconds
        run.info["of_limits"] = fraction_of_limit(config, mode, limits, out_per_s,
                                                  len(w.prompts), all_per_s)


def model_vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text(encoding="utf-8"))["vocab_size"])


def check_gguf(gguf: Path | None, num_models: int) -> None:
    """ValueError unless `gguf` is None or an existing file standing for the one --model."""
    if gguf is None:
        return
    if not gguf.is_file():
        raise ValueError(f"--gguf {gguf}: no such file; pass the --model's GGUF file")
    if num_models != 1:
        raise ValueError(f"--gguf is one model's file but {num_models} models were given: run "
                         "one --model with it")


def run(args: argparse.Namespace) -> int:
    err = Console(stderr=True)
    sizes = WorkloadSizes(args.num_prompts, args.prompt_len, args.output_len, args.prefix_len,
                          args.suffix_len, args.prefix_output_len, args.seed)
    try:
        sizes.check()
        if min(args.threads, args.repeats) < 1 or not args.kv_cache_gib > 0:
            raise ValueError("--threads and --repeats must be at least 1, --kv-cache-gib > 0")
        require_plots(args.plot)
        model_dirs = {m: ensure_bench_model(m) for m in dict.fromkeys(args.model)}
        check_gguf(args.gguf, len(model_dirs))
        peers = chosen_peers(args.peer, args.gguf)
    except (ValueError, PlotsUnavailable) as exc:
        err.print(str(exc), style="red", markup=False, soft_wrap=True)
        return 2
    for name, reason in peers.items():
        if reason is not None:
            err.print(f"[yellow]{name}: skipped: {reason}[/]", soft_wrap=True)
    limits = measure(args.threads) if args.machine_limits else None
    if limits is not None:
        err.print(format_limits(limits), soft_wrap=True, highlight=False, markup=False)
    cells: list[Cell] = []
    for model, model_dir in model_dirs.items():
        workloads = [build_workload(w, sizes, model_vocab_size(model_dir))
                     for w in dict.fromkeys(args.workload)]
        longest = max(w.max_prompt_len + w.max_tokens for w in workloads)
        if longest > args.max_model_len:
            err.print(f"[red]{model}: prompt + output reaches {longest} tokens, over "
                      f"--max-model-len {args.max_model_len}[/]", soft_wrap=True)
            return 2
        by_system: dict[str, list[RunResult]] = {}
        for precision in dict.fromkeys(args.precision):
            system = kvserve_system(precision)
            err.print(f"[dim]{model}: running {system}[/]")
            try:
                by_system[system] = run_in_process(system, model_dir, workloads, args, err,
                                                   precision)
            except ValueError as exc:  # e.g. --max-model-len beyond the model's positions
                err.print(f"[red]{model}: {exc}[/]", soft_wrap=True)
                return 2
            if limits is not None:
                add_limit_shares(model_dir, precision, workloads, by_system[system], limits)
        for peer, reason in peers.items():
            dtypes = dict.fromkeys(args.vllm_dtype) if peer == VLLM else [None]
            for dtype in dtypes:
                system = peer if dtype is None else vllm_system(dtype)
                err.print(f"[dim]{model}: running {system}[/]")
                if reason is not None:
                    by_system[system] = [RunResult(system, skipped=reason) for _ in workloads]
                elif dtype is not None:
                    by_system[system] = run_vllm(model_dir, workloads, args, err, dtype)
                elif peer == LLAMACPP:
                    assert args.gguf is not None
                    by_system[system] = run_llamacpp(args.gguf, model_vocab_size(model_dir),
                                                     workloads, args, err)
                else:
                    by_system[system] = run_in_process(peer, model_dir, workloads, args, err)
        for i, w in enumerate(workloads):
            cell = Cell(model, str(model_dir), w, [runs[i] for runs in by_system.values()])
            cells.append(cell)
            line = json.dumps(cell.as_dict() | ({"machine": limits.as_dict()} if limits else {}))
            if args.json:
                print(line, flush=True)
            if args.json_out is not None:
                with open(args.json_out, "a", encoding="utf-8") as f:
                    f.write(line + "\n")
    title = (f"engine throughput and TTFT ({args.threads} threads, greedy, "
             f"{args.kv_cache_gib:g} GiB KV)")
    if not args.json:
        print_table(cells, title)
    if args.plot is not None:
        try:
            path = engine_plot([c.as_dict() for c in cells], args.plot,
                               f"kvserve bench engine: {args.threads} threads, greedy")
        except PlotsUnavailable as exc:
            err.print(str(exc), style="red", markup=False, soft_wrap=True)
            return 2
        err.print(f"wrote {path}", soft_wrap=True, highlight=False)
    return 0

