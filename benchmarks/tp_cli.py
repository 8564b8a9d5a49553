"""`python -m benchmarks tp`: tensor parallelism against one rank on the same cores, same tokens.

For each size in `--tp`, one engine over a benchmark model (random weights, built locally),
the same decode-heavy batch submitted at once (greedy, EOS ignored), run once untimed to warm
up, then timed. Every size gets the same number of cores in total (`--cores`, split evenly over
the ranks). Reports output tokens/s, steps, and where rank 0's wall time went: inside each
collective (all_reduce in every layer, the step check's all_gather, the plan's broadcast) and
outside them (model compute, scheduling, sampling); plus the summed rank skew, and whether the
tokens equal the first size's.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field

from rich.console import Console
from rich.table import Table


@dataclass(slots=True)
class TPRow:
    """One tensor-parallel size's timed run."""

    tp: int
    threads_per_rank: int
    wall_s: float
    output_tok_s: float
    steps: int
    collective_s: dict[str, float] = field(default_factory=dict)  # op -> seconds on rank 0
    collective_calls: dict[str, int] = field(default_factory=dict)
    rank_skew_s: float = 0.0
    same_tokens: bool = True


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("tp", help="tensor parallelism vs one rank on the same cores")
    p.add_argument("--model", default="100m", help="tiny, 100m or a checkpoint directory")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="sizes to compare")
    p.add_argument("--cores", type=int, default=2, help="torch threads in total per size")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--json", dest="json_path", default=None, help="also write rows here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.bench.engine_workloads import (
        DECODE_HEAVY,
        WorkloadSizes,
        build_workload,
        ensure_bench_model,
    )
    from kvserve.model import ModelConfig

    path = ensure_bench_model(args.model)
    vocab = ModelConfig.from_file(path / "config.json").vocab_size
    sizes = WorkloadSizes(num_prompts=args.num_prompts, prompt_len=args.prompt_len,
                          output_len=args.output_len)
    workload = build_workload(DECODE_HEAVY, sizes, vocab)
    rows: list[TPRow] = []
    reference: list[list[int]] | None = None
    for tp in args.tp:
        row, tokens = _measure(str(path), tp, max(1, args.cores // tp), workload)
        reference = tokens if reference is None else reference
        row.same_tokens = tokens == reference
        rows.append(row)
    _print(rows, args)
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
    return 0


def _measure(path: str, tp: int, threads: int, workload) -> tuple[TPRow, list[list[int]]]:  # type: ignore[no-untyped-def]
    from kvserve.engine import SamplingParams
    from kvserve.runtime import EngineArgs, LLMEngine

    engine = LLMEngine.from_args(EngineArgs(model=path, dtype="float32", num_threads=threads,
                                            tensor_parallel_size=tp,
                                            kv_cache_memory_bytes=1 << 30))
    try:
        def generate(prompts, max_tokens: int, tag: str) -> tuple[float, int, list[list[int]]]:  # type: ignore[no-untyped-def]
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            ids = [f"{tag}{i}" for i in range(len(prompts))]
            for rid, prompt in zip(ids, prompts, strict=True):
                engine.add_request(rid, list(prompt), params)
            steps, done = 0, {}
            start = time.perf_counter()
            while engine.has_unfinished:
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out.outputs[0].token_ids
                steps += 1
            return time.perf_counter() - start, steps, [done[r] for r in ids]

        generate(workload.warmup_prompts, workload.warmup_max_tokens, "w")
        engine.kv_cache.reset_prefix_cache()
        before = engine.collective_stats.snapshot() if engine.collective_stats else None
        wall, steps, tokens = generate(workload.prompts, workload.max_tokens, "t")
        row = TPRow(tp, threads, wall, sum(map(len, tokens)) / wall, steps)
        if engine.collective_stats is not None and before is not None:
            after = engine.collective_stats.snapshot()
            for (op, _), hist in after.durations.items():
                old = before.durations.get((op, _))
                row.collective_s[op] = hist.total - (old.total if old else 0.0)
                row.collective_calls[op] = hist.count - (old.count if old else 0)
            row.rank_skew_s = after.rank_skew.total - before.rank_skew.total
        return row, tokens
    finally:
        engine.close()


def _print(rows: list[TPRow], args: argparse.Namespace) -> None:
    table = Table(title=f"python -m benchmarks tp: {args.model}, {args.num_prompts} x "
                        f"({args.prompt_len} prompt + {args.output_len} output), "
                        f"{args.cores} cores per size")
    for col in ("tp", "threads/rank", "wall s", "out tok/s", "steps", "all_reduce s (calls)",
                "all_gather s", "broadcast s", "outside collectives s", "skew s", "same tokens"):
        table.add_column(col)
    for r in rows:
        coll = sum(r.collective_s.values())
        table.add_row(str(r.tp), str(r.threads_per_rank), f"{r.wall_s:.2f}",
                      f"{r.output_tok_s:.1f}", str(r.steps),
                      f"{r.collective_s.get('all_reduce', 0):.2f} "
                      f"({r.collective_calls.get('all_reduce', 0)})",
                      f"{r.collective_s.get('all_gather', 0):.2f}",
                      f"{r.collective_s.get('broadcast', 0):.2f}",
                      f"{r.wall_s - coll:.2f}", f"{r.rank_skew_s:.2f}", str(r.same_tokens))
    Console(width=200).print(table)
