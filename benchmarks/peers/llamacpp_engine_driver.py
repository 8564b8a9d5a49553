"""Run `kvserve bench engine` workloads through llama.cpp (llama-cpp-python's `Llama`) on a GGUF.

Run from the peer venv (see docs/peers.md); it imports nothing from kvserve:

    $PEERS/llamacpp/bin/python benchmarks/peers/llamacpp_engine_driver.py --spec SPEC.json

SPEC.json: {"gguf": FILE, "vocab_size": V, "max_model_len": N, "num_threads": T, "repeats": R,
"workloads": [{"name", "prompts", "max_tokens", "warmup_prompts", "warmup_max_tokens"}, ...]}
(the workloads as vllm_engine_driver.py takes them).

Contract:
- One `llama_cpp.Llama` per run: `n_ctx` N, `n_threads` = `n_threads_batch` = T, no GPU layers,
  llama.cpp's default batch sizes, the file's own weight types (its quantized dot products: greedy
  tokens may differ from a float32 engine's). The file's vocabulary must have V tokens (the
  checkpoint the other systems load), else ValueError: the token ids would mean other tokens.
- One sequence at a time: a `Llama` holds a single sequence, so a batch's requests run back to
  back in order. Each reuses the KV of the prefix it shares with the request before it
  (`Llama.generate`'s prompt reuse, the only prefix caching it has); `cached_prompt_tokens`
  counts those tokens by generate's rule (a fully shared prompt re-evaluates its last token).
- Per workload: `reset()` and an untimed warm-up on the workload's warm-up prompts (other
  tokens), then R times `reset()` (a cold KV) + the timed batch, keeping the best output tokens/s.
- Timed: from just before the first request's `generate` until the last request's last token is
  sampled. TTFT of a request: from the batch's start (all requests are submitted at once, as for
  the other systems) to its first sampled token, so it includes the wait behind earlier requests;
  `info.own_ttft_mean_s` is the mean from each request's own start instead.
- Requests: prompts as token ids, greedy (temperature 0: llama.cpp's greedy sampler, repeat
  penalty 1), exactly `max_tokens` tokens: `generate` never stops by itself, so EOS is sampled
  like any other token and decoding goes on past it (what vLLM's `ignore_eos` does).
- `peak_rss_mib` of a workload: this process's peak resident set (VmHWM) when the workload ends
  (load and earlier workloads included; llama.cpp runs in this one process).
- Output: exactly one JSON object on stdout ({"llama_cpp_version", "load_seconds", "results":
  [...]}, one result per workload in vllm_engine_driver.py's format, or {"error": ...} for a
  workload that failed); logs and errors go to stderr; a failure to start exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # mypy checks the sibling under its package name
    from benchmarks.peers.driver_output import peak_rss_mib, print_result
else:
    from driver_output import peak_rss_mib, print_result  # this folder (run as a script)

SYSTEM = "llamacpp"
SPEC_KEYS = {"gguf": str, "vocab_size": int, "max_model_len": int, "num_threads": int,
             "repeats": int, "workloads": list}
WORKLOAD_KEYS = ("name", "prompts", "max_tokens", "warmup_prompts", "warmup_max_tokens")


def check_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """`spec` itself once every key is present with its type and every count is positive;
    ValueError naming the first key that is not."""
    for key, kind in SPEC_KEYS.items():
        if not isinstance(spec.get(key), kind) or isinstance(spec.get(key), bool):
            raise ValueError(f"spec key {key!r} must be a {kind.__name__}, got "
                             f"{spec.get(key)!r}")
        if kind is int and spec[key] < 1:
            raise ValueError(f"spec key {key!r} must be at least 1, got {spec[key]}")
    for n, workload in enumerate(spec["workloads"]):
        missing = [k for k in WORKLOAD_KEYS if k not in workload]
        if missing:
            raise ValueError(f"workload {n} lacks {', '.join(missing)}")
    return spec


def check_fits(prompts: Sequence[Sequence[int]], max_tokens: int, vocab_size: int,
               n_ctx: int) -> None:
    """ValueError unless every prompt's ids are in the vocabulary and prompt + output fits n_ctx."""
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary "
                             f"(0..{vocab_size - 1})")
        if len(prompt) + max_tokens > n_ctx:
            raise ValueError(f"prompt {i}: {len(prompt)} + {max_tokens} tokens exceed n_ctx "
                             f"{n_ctx}; raise --max-model-len")


def reused_prefix(cached: Sequence[int], prompt: Sequence[int]) -> int:
    """Prompt tokens `Llama.generate` takes from the KV of `cached` (the tokens evaluated so
    far): the longest common prefix, one less when it is the whole prompt (the last prompt token
    is evaluated again for fresh logits)."""
    n = 0
    for a, b in zip(cached, prompt, strict=False):
        if a != b:
            break
        n += 1
    return n - 1 if n == len(prompt) and n > 0 else n


def generate(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int) -> dict[str, Any]:
    """The batch, one request after another on `llm` (a `Llama`, or anything with its
    `generate`, `input_ids` and `n_tokens`); vllm_engine_driver.py's result format."""
    # Invariant: one sequence lives in `llm` at a time; a request's tokens are the first
    # `max_tokens` that its generator yields, and closing the generator ends the request.
    first = [0.0] * len(prompts)
    own_start = [0.0] * len(prompts)
    tokens: list[list[int]] = [[] for _ in prompts]
    cached = 0
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        own_start[i] = time.perf_counter()
        if llm.n_tokens > 0:
            cached += reused_prefix(list(llm.input_ids[:llm.n_tokens]), prompt)
        stream = llm.generate(list(prompt), temp=0.0, repeat_penalty=1.0, reset=True)
        try:
            for token in stream:
                if not tokens[i]:
                    first[i] = time.perf_counter()
                tokens[i].append(int(token))
                if len(tokens[i]) == max_tokens:
                    break
        finally:
            stream.close()
    seconds = time.perf_counter() - start
    own = [f - s for f, s in zip(first, own_start, strict=True)]
    return {"system": SYSTEM, "seconds": seconds, "num_output_tokens": sum(map(len, tokens)),
            "ttft_s": [f - start for f in first], "output_token_ids": tokens,
            "cached_prompt_tokens": cached, "own_ttft_mean_s": sum(own) / len(own)}


def run_workload(llm: Any, workload: dict[str, Any], repeats: int, vocab_size: int,
                 n_ctx: int) -> dict[str, Any]:
    """Warm-up, then `repeats` cold timed batches; the best by output tokens/s, with
    `info.seconds_all` (every repeat), `cached_prompt_tokens` and `own_ttft_mean_s` in info."""
    for prompts, max_tokens in ((workload["warmup_prompts"], workload["warmup_max_tokens"]),
                                (workload["prompts"], workload["max_tokens"])):
        check_fits(prompts, max_tokens, vocab_size, n_ctx)
    llm.reset()
    generate(llm, workload["warmup_prompts"], workload["warmup_max_tokens"])
    runs = []
    for _ in range(repeats):
        llm.reset()
        runs.append(generate(llm, workload["prompts"], workload["max_tokens"]))
    best = max(runs, key=lambda r: r["num_output_tokens"] / r["seconds"])
    best["info"] = {"seconds_all": [r["seconds"] for r in runs],
                    "cached_prompt_tokens": best.pop("cached_prompt_tokens"),
                    "own_ttft_mean_s": best.pop("own_ttft_mean_s")}
    return best


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp

    check_spec(spec)
    threads, n_ctx = spec["num_threads"], spec["max_model_len"]
    started = time.perf_counter()
    llm = llama_cpp.Llama(model_path=spec["gguf"], n_ctx=n_ctx, n_threads=threads,
                          n_threads_batch=threads, n_gpu_layers=0, seed=0, verbose=False)
    load_seconds = time.perf_counter() - started
    if llm.n_vocab() != spec["vocab_size"]:
        raise ValueError(f"{spec['gguf']} has {llm.n_vocab()} tokens, the model directory "
                         f"{spec['vocab_size']}: pass --gguf of the same model")
    info = {"n_ctx": llm.n_ctx(), "n_batch": llm.n_batch, "n_threads": threads,
            "file_type": llm.metadata.get("general.file_type"), "one_sequence_at_a_time": True}
    results = []
    for workload in spec["workloads"]:
        try:
            best = run_workload(llm, workload, spec["repeats"], spec["vocab_size"], n_ctx)
            best["info"] = info | best["info"]
            best["peak_rss_mib"] = peak_rss_mib()
            results.append(best)
        except Exception as exc:  # report this workload, keep going with the next
            traceback.print_exc()
            results.append({"error": f"{type(exc).__name__}: {exc}"})
    return {"llama_cpp_version": llama_cpp.__version__, "load_seconds": load_seconds,
            "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="JSON file: GGUF, sizes and workloads")
    args = parser.parse_args(argv)

    def produce() -> dict[str, Any]:
        with open(args.spec, encoding="utf-8") as f:
            return run(json.load(f))

    return print_result("llamacpp_engine_driver", produce)


if __name__ == "__main__":
    sys.exit(main())
