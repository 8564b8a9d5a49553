"""`python -m benchmarks text-capacity`: what `text_capacity`'s sampling costs and what it buys.

The gateway tokenizes one completion prompt in `every` to measure characters per token
(src/kvserve/gateway/fleet/text_capacity.py). Prompts are natural English: the chats of
benchmarks/data/tenant_chats.json, each user turn as a completion prompt (the tenant's system
prompt and the user turns so far), in the `--tokenizer` directory's tokenizer.json.

- cost: CPU time (process time, so other load on the machine inflates it less than wall time)
  of one `encode` of a prompt of each `--tokens` size, median of `--repeats`, and that divided
  by `every`: the gateway's CPU per request, beside `--router-cpu-ms` (the proxy's own CPU per
  request, docs/benchmarks.md "Router CPU");
- accuracy: the chat prompts drawn at random `--draws` times in each of `--orders` orders; after
  k samples, the measured ratio (characters over tokens, summed, as `TextCapacity` sums them)
  against the whole pool's, |measured / true - 1|; and the real `TextCapacity` fed every draw
  (every=1) at each rescale threshold: how often it re-tells the policy, and how far its applied
  ratio ends from the true one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from tokenizers import Tokenizer

from benchmarks import ROOT
from kvserve.gateway.core.prefix import CHARS_PER_TOKEN
from kvserve.gateway.fleet import text_capacity
from kvserve.gateway.fleet.text_capacity import TextCapacity

CHATS = ROOT / "benchmarks" / "data" / "tenant_chats.json"
_KV_TOKENS = 1 << 20  # a worker's capacity, large so the policy's rounding is negligible


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("text-capacity", help="text_capacity's sampling: tokenize cost per "
                       "request and the measured ratio's error by samples",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", type=Path, required=True,
                   help="a model directory with tokenizer.json (e.g. SmolLM2's)")
    p.add_argument("--tokens", default="2048,3072", help="prompt sizes timed, tokens")
    p.add_argument("--every", default="1,8,32,128", help="sampling rates costed")
    p.add_argument("--repeats", type=int, default=50, help="encodes timed per size")
    p.add_argument("--router-cpu-ms", type=float, default=2.8,
                   help="the proxy's CPU per request to compare with (docs/benchmarks.md)")
    p.add_argument("--samples", default="1,2,4,8,16,64", help="sample counts of the error table")
    p.add_argument("--changes", default="0.02,0.05,0.1", help="rescale thresholds compared")
    p.add_argument("--draws", type=int, default=64, help="prompts drawn per order")
    p.add_argument("--orders", type=int, default=200, help="random orders (seeds 0..N-1)")
    p.add_argument("--json", action="store_true", help="also print the figures as JSON")
    p.set_defaults(func=run)


def chat_prompts(path: Path = CHATS) -> list[str]:
    """Every user turn of every chat as a completion prompt: system prompt, then the turns."""
    prompts = []
    for tenant in json.loads(path.read_text(encoding="utf-8"))["tenants"]:
        for turns in tenant["conversations"]:
            for i in range(len(turns)):
                prompts.append(tenant["system"] + "".join(f"\n\nUser: {t}" for t in turns[:i + 1]))
    return prompts


def _sized_prompt(tokenizer: Tokenizer, text: str, tokens: int) -> str:
    """The first `tokens` tokens of `text` (repeated as needed), as text."""
    while len(tokenizer.encode(text, add_special_tokens=False).ids) < tokens:
        text += "\n\n" + text
    return text[: tokenizer.encode(text, add_special_tokens=False).offsets[tokens - 1][1]]


def cost_rows(tokenizer: Tokenizer, prompts: list[str], sizes: list[int], every: list[int],
              repeats: int) -> list[dict[str, float]]:
    """Per prompt size: the median CPU ms of one encode, and per request at each `every`."""
    text = "\n\n".join(prompts)
    rows = []
    for size in sizes:
        prompt = _sized_prompt(tokenizer, text, size)
        times = []
        for _ in range(repeats):
            start = time.process_time()
            tokenizer.encode(prompt, add_special_tokens=False)
            times.append((time.process_time() - start) * 1e3)
        ms = statistics.median(times)
        rows.append({"tokens": size, "chars": len(prompt), "encode_ms": ms,
                     **{f"every_{e}_ms": ms / e for e in every}})
    return rows


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "p90": ordered[int(0.9 * (len(ordered) - 1))],
            "max": ordered[-1]}


class _Told:
    """A policy that counts the capacities it is told and keeps the last."""

    def __init__(self) -> None:
        self.times = 0
        self.kv_tokens = 0

    def set_worker_capacity(self, worker_id: str, kv_tokens: int) -> None:
        self.times += 1
        self.kv_tokens = kv_tokens


def accuracy(tokenizer: Tokenizer, prompts: list[str], samples: list[int], changes: list[float],
             draws: int, orders: int) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """The error after each count of `samples`, and per rescale threshold the rescales and the
    applied ratio's final error, over `orders` random orders of `draws` prompts."""
    counts = [(len(p), len(tokenizer.encode(p, add_special_tokens=False).ids)) for p in prompts]
    true = sum(c for c, _ in counts) / sum(t for _, t in counts)
    streams = [random.Random(seed).choices(range(len(prompts)), k=draws)
               for seed in range(orders)]
    errors: dict[int, list[float]] = {k: [] for k in samples if k <= draws}
    for stream in streams:
        chars = tokens = 0
        for n, idx in enumerate(stream, 1):
            chars, tokens = chars + counts[idx][0], tokens + counts[idx][1]
            if n in errors:
                errors[n].append(abs(chars / tokens / true - 1))
    error_rows = [{"samples": k, **_quantiles(v)} for k, v in errors.items()]
    rescale_rows = []
    old = text_capacity.RESCALE_CHANGE
    try:
        for change in changes:
            text_capacity.RESCALE_CHANGE = change
            rescales, final = [], []
            for stream in streams:
                told = _Told()
                capacity = TextCapacity(told, every=1)
                capacity.tokenizer = tokenizer
                capacity.worker_capacity("w", _KV_TOKENS)
                for idx in stream:
                    capacity.sample(prompts[idx])
                rescales.append(float(told.times - 1))
                applied = told.kv_tokens / _KV_TOKENS * CHARS_PER_TOKEN
                final.append(abs(applied / true - 1))
            rescale_rows.append({"change": change, "rescales_median": statistics.median(rescales),
                                 "rescales_max": max(rescales), **{
                                     f"final_error_{k}": v for k, v in _quantiles(final).items()}})
    finally:
        text_capacity.RESCALE_CHANGE = old
    return error_rows, rescale_rows


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def run(args: argparse.Namespace) -> int:
    out = Console(width=160)
    tokenizer = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    prompts = chat_prompts()
    every = _ints(args.every)
    load = os.getloadavg()
    costs = cost_rows(tokenizer, prompts, _ints(args.tokens), every, args.repeats)
    table = Table(title=f"cost: CPU ms per encode, and per request (router's own: "
                        f"{args.router_cpu_ms} ms); load average {load[0]:.2f}")
    for col in ("tokens", "chars", "encode ms", *(f"every={e}" for e in every)):
        table.add_column(col)
    for r in costs:
        table.add_row(str(r["tokens"]), str(r["chars"]), f"{r['encode_ms']:.2f}", *(
            f"{r[f'every_{e}_ms']:.3f} ({r[f'every_{e}_ms'] / args.router_cpu_ms:.1%})"
            for e in every))
    out.print(table)
    errors, rescales = accuracy(tokenizer, prompts, _ints(args.samples),
                                [float(c) for c in args.changes.split(",")], args.draws,
                                args.orders)
    table = Table(title=f"accuracy: |measured / true - 1| after k samples, {len(prompts)} chat "
                        f"prompts, {args.orders} orders")
    for col in ("samples", "median", "p90", "max"):
        table.add_column(col)
    for r in errors:
        table.add_row(str(r["samples"]), *(f"{r[q]:.2%}" for q in ("median", "p90", "max")))
    out.print(table)
    table = Table(title=f"rescale threshold: policy re-told over {args.draws} samples "
                        f"(min samples {text_capacity.MIN_SAMPLES}), applied ratio's error")
    for col in ("change", "rescales median/max", "final error median/p90/max"):
        table.add_column(col)
    for r in rescales:
        table.add_row(f"{r['change']:g}", f"{r['rescales_median']:g}/{r['rescales_max']:g}",
                      "/".join(f"{r[f'final_error_{q}']:.2%}" for q in ("median", "p90", "max")))
    out.print(table)
    if args.json:
        print(json.dumps({"load_average": load, "cost": costs, "error": errors,
                          "rescale": rescales}))
    return 0
