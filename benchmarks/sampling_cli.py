"""`python -m benchmarks sampling`: what turning logits into tokens costs a step, by sampling mode.

- The sampler alone: `Sampler.sample` over [rows, vocab] float32 logits (normal, scaled by 4:
  a peaked row, as a model's), for greedy, temperature 1.0 (the OpenAI API's default) and the
  top-p / top-k / min-p settings chat clients send. Median of `--repeats` calls after three
  warm-ups, ms a call.
- With `--model`: one stream through the offline engine (`LLM.generate`, a 128-token prompt,
  `--output-len` tokens, `ignore_eos`), its ITL under each mode, the modes alternated for
  `--rounds` rounds in one process, so the model's step and the machine's drift are shared.

Run it on two checkouts (`PYTHONPATH=CHECKOUT/src`) to compare samplers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any

MODES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature 1.0": {"temperature": 1.0},
    "t 0.7, top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "t 0.7, top_k 50": {"temperature": 0.7, "top_k": 50},
    "t 0.7, top_p 0.95, min_p 0.05": {"temperature": 0.7, "top_p": 0.95, "min_p": 0.05},
}
ENGINE_MODES = ("greedy", "temperature 1.0", "t 0.7, top_p 0.9")
PROMPT_LEN = 128


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("sampling", help="the sampler's cost a step by sampling mode, alone "
                       "and (with --model) in one stream's ITL")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64],
                   help="requests sampled a step")
    p.add_argument("--vocab", type=int, default=49152, help="default: SmolLM2's vocabulary")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", help="a model path: also time one stream's ITL by mode")
    p.add_argument("--quantization", default=None, help="the engine's --quantization (gguf)")
    p.add_argument("--output-len", type=int, default=150)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=run)


def sampler_ms(rows: list[int], vocab: int, repeats: int) -> dict[str, dict[str, float]]:
    """{mode: {rows: ms a Sampler.sample call}}."""
    import torch

    from kvserve.engine import Request, SamplingParams
    from kvserve.model.sampler import Sampler

    out: dict[str, dict[str, float]] = {mode: {} for mode in MODES}
    for n in rows:
        logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0)) * 4
        for mode, params in MODES.items():
            sampler = Sampler(seed=0)
            requests = [Request(f"r{i}", [1, 2, 3], SamplingParams(**params))
                        for i in range(n)]
            times = []
            with torch.inference_mode():
                for _ in range(repeats + 3):
                    start = time.perf_counter()
                    sampler.sample(logits, requests)
                    times.append(time.perf_counter() - start)
            out[mode][str(n)] = statistics.median(times[3:]) * 1e3
    return out


def engine_itl(model: str, quantization: str | None, output_len: int,
               rounds: int) -> dict[str, list[float]]:
    """{mode: ITL ms of each round}: a one-token request (prefill and set-up) is subtracted
    from an `output_len` one, so only decode steps count."""
    from kvserve.engine import SamplingParams
    from kvserve.runtime import LLM

    llm = LLM(model=model, dtype="float32", max_num_seqs=8, num_kv_blocks=1024,
              quantization=quantization)
    prompt = {"prompt_token_ids": list(range(4, 4 + PROMPT_LEN))}
    llm.generate([prompt], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    for thread in threading.enumerate():  # the grammar vocabulary, built in the background
        if thread.name == "grammar-tokenizer":
            thread.join()
    out: dict[str, list[float]] = {mode: [] for mode in ENGINE_MODES}
    for r in range(rounds):
        for mode in ENGINE_MODES:
            params = dict(MODES[mode], ignore_eos=True, seed=r)
            start = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=1, **params), use_tqdm=False)
            first = time.perf_counter() - start
            start = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=output_len, **params),
                         use_tqdm=False)
            whole = time.perf_counter() - start
            out[mode].append((whole - first) / (output_len - 1) * 1e3)
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    if min(args.rows) < 1 or args.vocab < 2 or args.repeats < 1 or args.threads < 1:
        raise SystemExit("--rows, --repeats and --threads must be at least 1, --vocab 2")
    if args.output_len < 2 or args.rounds < 1:
        raise SystemExit("--output-len must be at least 2 and --rounds at least 1")
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {"threads": args.threads, "vocab": args.vocab,
                              "sampler_ms": sampler_ms(args.rows, args.vocab, args.repeats)}
    if args.model:
        result["itl_ms"] = engine_itl(args.model, args.quantization, args.output_len,
                                      args.rounds)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"Sampler.sample, ms a call ({args.vocab} tokens a row, {args.threads} threads)")
    print("| mode | " + " | ".join(f"{n} rows" for n in args.rows) + " |")
    print("|---|" + "---|" * len(args.rows))
    for mode, by_rows in result["sampler_ms"].items():
        print(f"| {mode} | " + " | ".join(f"{by_rows[str(n)]:.3f}" for n in args.rows) + " |")
    if args.model:
        print(f"\nOne stream, offline, {PROMPT_LEN} tokens in, {args.output_len} out: ITL ms")
        print("| mode | median | rounds |\n|---|---|---|")
        for mode, itls in result["itl_ms"].items():
            print(f"| {mode} | {statistics.median(itls):.2f} | "
                  + ", ".join(f"{x:.2f}" for x in itls) + " |")
    return 0
