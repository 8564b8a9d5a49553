"""`python -m benchmarks precision`: the numerics of kvserve's bf16, packed-weight and w8a8 (bf16
with int8 x int8 projections) modes on a real model's chat prompts, against float32.

For each mode: the logit error (the mode's logits against float32's on the same tokens: each
chat prompt followed by float32's greedy continuation, every continuation position compared),
the teacher-forced top-1 agreement on those positions, and the free-running greedy agreement
(each mode generates greedily on its own; the share of float32's tokens it reproduces before
the first difference, and the share of prompts it reproduces whole). For a model dequantized
from a GGUF file the float32 weights are that file's dequantization, and `q4_1` re-packs them
into the file's own Q4_1 blocks (the lm_head, the file's Q8_0 embeddings, into Q8_0).

`--kv-cache-dtype bf16` (or fp16) runs the measured modes over that KV cache (float32 stays the
reference, over a float32 one); mode `float32` then measures the cache's rounding alone.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

CHATS = (
    "What is the capital of France, and why is it famous?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences what a hash table is.",
    "Give me three tips for sleeping better.",
    "Translate 'good morning, how are you?' into Spanish.",
    "What is 17 times 23? Show your steps.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "Write a Python function that reverses a string.",
)
MODES = ("bfloat16", "q4_0", "q4_1", "q8_0", "w8a8")  # the default; "float32" may be asked for


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("precision", help="logit error and greedy agreement of kvserve's "
                       "bf16 and packed modes against float32, on chat prompts")
    p.add_argument("--model", required=True, help="a checkpoint directory")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=("float32", *MODES))
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bf16", "fp16"),
                   help="the measured modes' KV cache (the float32 reference keeps its own)")
    p.add_argument("--max-tokens", type=int, default=48, help="greedy tokens per prompt")
    p.add_argument("--threads", type=int, default=2)
    p.set_defaults(func=run)


def _engine_args(model: str, mode: str, threads: int, kv_cache_dtype: str = "auto") -> Any:
    from kvserve.runtime import EngineArgs

    quantized = mode.startswith("q") or mode == "w8a8"
    dtype = "bfloat16" if mode in ("bfloat16", "w8a8") else "float32"  # w8a8: bf16 between
    return EngineArgs(model=model, dtype=dtype,
                      quantization=mode if quantized else None, num_threads=threads,
                      kv_cache_memory_bytes=64 << 20, kv_cache_dtype=kv_cache_dtype)


def _greedy(model: str, mode: str, chats: list[list[dict[str, str]]], max_tokens: int,
            threads: int, kv_cache_dtype: str = "auto",
            ) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, greedy output ids) of every chat, through kvserve's engine in `mode`."""
    from dataclasses import asdict

    from kvserve.engine import SamplingParams
    from kvserve.runtime import LLM

    llm = LLM(**asdict(_engine_args(model, mode, threads, kv_cache_dtype)))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.chat(chats, params, use_tqdm=False)
    return [list(o.prompt_token_ids) for o in outs], [list(o.outputs[0].token_ids) for o in outs]


def _logits(model: str, mode: str, sequences: list[tuple[list[int], list[int]]],
            threads: int, kv_cache_dtype: str = "auto") -> list[torch.Tensor]:
    """Per sequence (prompt, continuation): the mode's logits [len(continuation), vocab] at
    the positions that predict each continuation token."""
    from kvserve.model import AttentionMetadata, allocate_kv_caches
    from kvserve.model.tensor_parallel import ShardSpec
    from kvserve.runtime.model_setup import kv_cache_torch_dtype, load_rank_model

    torch.set_num_threads(threads)
    args = _engine_args(model, mode, threads, kv_cache_dtype)
    loaded, _ = load_rank_model(args, ShardSpec(0, 1), "cpu")
    kv_dtype = kv_cache_torch_dtype(args, loaded.dtype)
    out = []
    for prompt, continuation in sequences:
        ids = torch.tensor(prompt + continuation[:-1])
        n = len(ids)
        blocks = (n + 15) // 16
        meta = AttentionMetadata.from_lists([n], [n], [list(range(blocks))], 16)
        kv = allocate_kv_caches(loaded.model.config, blocks, 16, dtype=kv_dtype, device="cpu")
        with torch.inference_mode():
            hidden = loaded.model(ids, torch.arange(n), kv, meta)  # [n, hidden]
            out.append(loaded.model.compute_logits(hidden[len(prompt) - 1:]))  # [cont, vocab]
    return out


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def run(args: argparse.Namespace) -> int:
    chats = [[{"role": "user", "content": text}] for text in CHATS]
    prompts, reference = _greedy(args.model, "float32", chats, args.max_tokens, args.threads)
    sequences = list(zip(prompts, reference, strict=True))
    base = _logits(args.model, "float32", sequences, args.threads)
    for mode in args.modes:
        logits = _logits(args.model, mode, sequences, args.threads, args.kv_cache_dtype)
        diffs = torch.cat([(a - b).abs().flatten() for a, b in zip(logits, base, strict=True)])
        scale = torch.cat([b.flatten() for b in base]).abs().max().item()
        top1 = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in
                   zip(logits, base, strict=True)) / sum(len(b) for b in base)
        _, outputs = _greedy(args.model, mode, chats, args.max_tokens, args.threads,
                             args.kv_cache_dtype)
        kept = [_first_difference(ref, got) for ref, got in zip(reference, outputs, strict=True)]
        print(json.dumps({
            "mode": mode, "kv_cache_dtype": args.kv_cache_dtype, "prompts": len(chats),
            "tokens_per_prompt": args.max_tokens,
            "logit_max_abs_err": diffs.max().item(), "logit_mean_abs_err": diffs.mean().item(),
            "max_abs_logit": scale, "teacher_forced_top1_agreement": top1,
            "greedy_tokens_before_first_difference": sum(kept) / sum(map(len, reference)),
            "greedy_identical_prompts": sum(k == len(r) for k, r in
                                            zip(kept, reference, strict=True)) / len(chats),
        }), flush=True)
    return 0
