"""`python -m benchmarks preemption`: swap vs recompute preemption on a forced small KV pool.

One engine per mode over the built-in demo model (made locally, no download), the same batch of
requests all queued at once into a pool that holds only a few of them, so the scheduler
preempts again and again. Reports wall time, output tokens/s, tokens computed (recomputes
included), preemptions (by swapping, and swaps that fell back to recompute), and whether every
mode produced the same greedy tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

MODES = ("recompute", "swap")


@dataclass(frozen=True, slots=True)
class PreemptionRow:
    """One mode's run: what it cost and how often it preempted."""

    mode: str
    wall_s: float
    output_tok_s: float
    computed_tokens: int
    preemptions: int
    swap_preemptions: int
    swap_fallbacks: int
    same_tokens: bool


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("preemption", help="swap vs recompute preemption on a small KV pool")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-kv-blocks", type=int, default=128,
                   help="device KV blocks of 16 tokens (small: forces preemption)")
    p.add_argument("--kv-host-tier-bytes", type=int, default=1 << 28,
                   help="host tier for swap mode (and for recompute mode, unless told not to)")
    p.add_argument("--recompute-host-tier", action=argparse.BooleanOptionalAction,
                   default=True, help="give recompute mode the host tier too (its prefix hits "
                   "then recover most of a victim's KV)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON object per mode")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch  # here, not at import: every `kvserve` command builds this parser

    from kvserve.engine import SamplingParams
    from kvserve.runtime import EngineArgs, LLMEngine

    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(10, 500, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    rows, reference = [], None
    for mode in MODES:
        host_bytes = args.kv_host_tier_bytes if (
            mode == "swap" or args.recompute_host_tier) else 0
        engine = LLMEngine.from_args(EngineArgs(
            num_kv_blocks=args.num_kv_blocks, kv_host_tier_bytes=host_bytes,
            preemption_mode=mode, max_num_seqs=args.num_prompts, num_threads=args.threads))
        for i, prompt in enumerate(prompts):
            engine.add_request(f"p{i}", prompt, params)
        tokens: dict[str, list[int]] = {}
        start = time.perf_counter()
        while engine.has_unfinished:
            for output in engine.step():
                if output.finished:
                    tokens[output.request_id] = output.outputs[0].token_ids
        wall = time.perf_counter() - start
        reference = reference or tokens
        scheduler, counters = engine.core.scheduler, engine.kv_cache.stats().counters
        rows.append(PreemptionRow(mode, wall, sum(map(len, tokens.values())) / wall,
                                  scheduler.num_scheduled_tokens, scheduler.num_preemptions,
                                  scheduler.num_swap_preemptions, counters.swap_fallbacks,
                                  tokens == reference))
    if args.json:
        for row in rows:
            print(json.dumps(asdict(row)))
        return 0
    print("| mode | wall (s) | output tok/s | tokens computed | preemptions | by swap | "
          "fallbacks | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.mode} | {r.wall_s:.1f} | {r.output_tok_s:.1f} | {r.computed_tokens} | "
              f"{r.preemptions} | {r.swap_preemptions} | {r.swap_fallbacks} | "
              f"{'yes' if r.same_tokens else 'NO'} |")
    return 0
