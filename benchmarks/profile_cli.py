"""`python -m benchmarks profile`: time kvserve's own engine on this machine and fit a cost profile.

The simulator (`kvserve simulate --profile kvserve`) then runs kvserve fleets with these step
times. Measured: whole `LLMEngine.step()` calls (scheduling, model, sampling), for prefill batches
of several sizes, for prefill chunks late in a long prompt (chunked prefill: the cost of reading
earlier context), and for decode steps of several batch sizes and contexts; prefix caching off,
so every prompt token is computed. With `--server`, a real `kvserve serve` is also timed on
short prompts and on prefix hits of long ones, behind a kvserve gateway: their TTFT minus the
fitted step is the request overhead (HTTP through the gateway, tokenization, hand-off) and its
growth per prompt token (profile_overhead.py). With `--colocated N`, N-1 other engines run a
steady load on this machine meanwhile, as the other workers of a local N-worker fleet would.
Fitted: the form of kvserve.sim.costmodel, by least squares on relative error (negative
coefficients clamped to 0 and refitted).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import random
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.profile_overhead import fit_overhead, measure_overhead
from kvserve.sim.costmodel import CostProfile, StepShape, attention_pairs
from kvserve.sim.profiles import measured_profile_path
from kvserve.sim.splitwise_fit import weighted_lstsq

PREFILL_SHAPES = ((32, 1), (128, 1), (512, 1), (1024, 1), (2048, 1), (128, 8), (256, 8))
"""(prompt tokens, prompts) per timed prefill step."""
DECODE_SHAPES = ((1, 64), (8, 64), (32, 64), (64, 64), (8, 1024), (32, 1024), (8, 3072))
"""(sequences, context tokens each) per timed decode run."""
QUICK_PREFILL = ((32, 1), (256, 1), (128, 4))
QUICK_DECODE = ((1, 32), (8, 32), (4, 512))
CHUNKED = ((3072, 128), (3072, 512))
"""(prompt tokens, chunk tokens): every chunk of the prompt is a timed step."""
QUICK_CHUNKED = ((512, 128),)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("profile", help="time kvserve's engine here; write a simulator profile")
    p.add_argument("--out", type=Path, default=None,
                   help=f"profile JSON (default {measured_profile_path()})")
    p.add_argument("--model", default=None, help="checkpoint dir or HF id (default: demo)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per shape (median)")
    p.add_argument("--decode-steps", type=int, default=8, help="timed decode steps per shape")
    p.add_argument("--quick", action="store_true", help="three small shapes each (a smoke test)")
    p.add_argument("--server", action="store_true",
                   help="also time a real `kvserve serve` for the request overhead")
    p.add_argument("--colocated", type=int, default=1, metavar="N",
                   help="measure while N-1 other engines run a steady load (a local N-worker "
                        "fleet's neighbours)")
    p.set_defaults(func=run)


class _Timer:
    """An LLMEngine with prefix caching off, and helpers that time its steps."""

    def __init__(self, model: str | None, threads: int | None, max_batched: int,
                 max_seqs: int) -> None:
        from kvserve.runtime import EngineArgs, LLMEngine

        self.args = EngineArgs(model=model, enable_prefix_caching=False, num_threads=threads,
                               max_num_batched_tokens=max_batched, max_num_seqs=max_seqs)
        self.engine = LLMEngine.from_args(self.args)
        self.vocab = self.engine.info.vocab_size
        self.rng = random.Random(0)
        self.next_id = 0

    def _add(self, num_seqs: int, prompt_len: int, max_tokens: int) -> None:
        from kvserve.engine import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for _ in range(num_seqs):
            prompt = [self.rng.randrange(self.vocab) for _ in range(prompt_len)]
            self.engine.add_request(f"p{self.next_id}", prompt, params)
            self.next_id += 1

    def chunked_ms(self, prompt_len: int) -> list[tuple[int, int, float]]:
        """(chunk start, chunk tokens, ms) of every step of one chunked prompt; the chunk size
        is this engine's max_num_batched_tokens."""
        self._add(1, prompt_len, 1)
        out = []
        request = self.engine.core.scheduler.waiting[0]
        while self.engine.has_unfinished:
            start_tok = request.num_computed_tokens
            start = time.perf_counter()
            self.engine.step()
            ms = (time.perf_counter() - start) * 1000.0
            done = request.num_computed_tokens - start_tok
            if done > 1 and start_tok < prompt_len:
                out.append((start_tok, done, ms))
        return out

    def _drain(self) -> None:
        while self.engine.has_unfinished:
            self.engine.step()

    def prefill_ms(self, prompt_len: int, num_seqs: int) -> float:
        """One step computing `num_seqs` prompts of `prompt_len` tokens (and sampling)."""
        self._add(num_seqs, prompt_len, 1)
        start = time.perf_counter()
        self.engine.step()
        ms = (time.perf_counter() - start) * 1000.0
        self._drain()
        return ms

    def decode_ms(self, num_seqs: int, context: int, steps: int) -> list[tuple[int, float]]:
        """(batch context, ms) of `steps` decode steps of `num_seqs` sequences."""
        self._add(num_seqs, context, steps + 2)
        while self.engine.core.scheduler.waiting or any(
                r.is_prefilling for r in self.engine.core.scheduler.running):
            self.engine.step()
        self.engine.step()  # the first decode step, untimed (allocator warm-up)
        out = []
        for _ in range(steps):
            ctx = sum(r.num_tokens for r in self.engine.core.scheduler.running)
            start = time.perf_counter()
            self.engine.step()
            out.append((ctx, (time.perf_counter() - start) * 1000.0))
        self._drain()
        return out


def _fit(rows: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Least squares with every coefficient >= 0: a negative one is dropped and the rest refit."""
    active = list(range(len(rows[0])))
    while True:
        coef = weighted_lstsq([[r[i] for i in active] for r in rows], y)
        if all(c >= 0 for c in coef) or len(active) == 1:
            full = [0.0] * len(rows[0])
            for i, c in zip(active, coef, strict=True):
                full[i] = max(c, 0.0)
            return full
        active.pop(min(range(len(coef)), key=lambda i: coef[i]))


def measure(args: argparse.Namespace, console: Console) -> tuple[CostProfile, list[Any]]:
    """Time the shapes and fit; returns the profile and (kind, shape, measured, fitted) rows."""
    prefill_shapes = QUICK_PREFILL if args.quick else PREFILL_SHAPES
    decode_shapes = QUICK_DECODE if args.quick else DECODE_SHAPES
    max_batched = max(p * b for p, b in prefill_shapes)
    timer = _Timer(args.model, args.threads, max(max_batched, 2048),
                   max(64, max(b for b, _ in decode_shapes)))
    timer.prefill_ms(64, 1)  # warm-up
    prefill: list[tuple[StepShape, float]] = []
    for prompt_len, num_seqs in prefill_shapes:
        ms = statistics.median(timer.prefill_ms(prompt_len, num_seqs)
                               for _ in range(args.repeats))
        pairs = num_seqs * attention_pairs(0, prompt_len)
        prefill.append((StepShape(prompt_len * num_seqs, pairs), ms))
        console.print(f"prefill {num_seqs} x {prompt_len}: {ms:.1f} ms")
    for prompt_len, chunk in QUICK_CHUNKED if args.quick else CHUNKED:
        chunker = _Timer(args.model, args.threads, chunk, 4)
        chunker.chunked_ms(chunk)  # warm-up
        for start, num_new, ms in chunker.chunked_ms(prompt_len):
            prefill.append((StepShape(num_new, attention_pairs(start, num_new),
                                      prefill_context=start), ms))
        console.print(f"chunked prefill of {prompt_len} tokens, {chunk} a step: "
                      f"{len(prefill)} prefill rows")
    decode: list[tuple[StepShape, float]] = []
    for num_seqs, context in decode_shapes:
        steps = timer.decode_ms(num_seqs, context, args.decode_steps)
        ctx = int(statistics.fmean(c for c, _ in steps))
        ms = statistics.median(m for _, m in steps)
        decode.append((StepShape(0, 0, num_seqs, ctx), ms))
        console.print(f"decode {num_seqs} seqs at {context} tokens: {ms:.1f} ms/step")
    base, per_token, per_pair, per_prefill_ctx = _fit(
        [(1.0, s.num_prefill_tokens, s.num_pairs, s.prefill_context) for s, _ in prefill],
        [m for _, m in prefill])
    d_base, per_seq, per_ctx = _fit(
        [(1.0, s.num_decode_seqs, s.decode_context) for s, _ in decode], [m for _, m in decode])
    engine = timer.engine
    draft = CostProfile(
        name="kvserve", source="", prefill_floor_ms=0.0, prefill_base_ms=base,
        prefill_ms_per_token=per_token, prefill_ms_per_pair=per_pair, decode_base_ms=d_base,
        decode_ms_per_seq=per_seq, decode_ms_per_context_token=per_ctx,
        prefill_ms_per_context_token=per_prefill_ctx,
        kv_capacity_tokens=engine.kv_cache.pool.num_blocks * engine.kv_cache.block_size,
        max_num_batched_tokens=2048, max_num_seqs=64)
    if args.server:
        from kvserve.runtime.demo_model import ensure_demo_model

        short, long = measure_overhead(timer.engine.model_path or ensure_demo_model(),
                                       args.threads, draft, console, quick=args.quick)
        base_ms, per_token_ms = fit_overhead(short, long)
        draft = replace(draft, request_overhead_ms=base_ms,
                        request_overhead_ms_per_prompt_token=per_token_ms)
        console.print(f"request overhead {base_ms:.2f} ms + {per_token_ms * 1000:.3f} us per "
                      "prompt token", highlight=False)
    rows = [("prefill", s, m, draft.step_s(s) * 1000.0) for s, m in prefill]
    rows += [("decode", s, m, draft.step_s(s) * 1000.0) for s, m in decode]
    pre = [abs(f - m) / m for k, _, m, f in rows if k == "prefill"]
    dec = [abs(f - m) / m for k, _, m, f in rows if k == "decode"]
    model = args.model or engine.model_name
    profile = CostProfile(**{
        **{f: getattr(draft, f) for f in draft.__dataclass_fields__},
        "source": f"python -m benchmarks profile: {model}, "
                  f"{engine.args.resolve_num_threads()} threads, "
                  + (f"{args.colocated} engines colocated, " if args.colocated > 1 else "")
                  + time.strftime("%Y-%m-%d"),
        "fit": {"rows": float(len(rows)),
                "prefill_mean_rel_err": round(statistics.fmean(pre), 4),
                "prefill_max_rel_err": round(max(pre), 4),
                "decode_mean_rel_err": round(statistics.fmean(dec), 4),
                "decode_max_rel_err": round(max(dec), 4)},
    })
    return profile, rows


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    if args.repeats < 1 or args.decode_steps < 1:
        console.print("[red]--repeats and --decode-steps must be >= 1[/]")
        return 2
    if args.colocated < 1:
        console.print("[red]--colocated must be >= 1[/]")
        return 2
    with colocated_load(args.colocated - 1, args.model, args.threads):
        profile, rows = measure(args, console)
    table = Table(title=f"kvserve step times, measured vs fitted ({profile.source})")
    for name in ("kind", "shape", "measured ms", "fitted ms", "error"):
        table.add_column(name, justify="left" if name in ("kind", "shape") else "right")
    for kind, shape, measured, fitted in rows:
        ctx = f" after {shape.prefill_context}" if shape.prefill_context else ""
        desc = (f"{shape.num_prefill_tokens} tokens{ctx}" if kind == "prefill"
                else f"{shape.num_decode_seqs} seqs, ctx {shape.decode_context}")
        table.add_row(kind, desc, f"{measured:.2f}", f"{fitted:.2f}",
                      f"{(fitted - measured) / measured:+.0%}")
    Console().print(table)
    out = args.out or measured_profile_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(profile.to_json() + "\n")
    console.print(f"wrote {out} (use it with `kvserve simulate --profile "
                  f"{'kvserve' if args.out is None else out}`)", soft_wrap=True)
    return 0


def _steady_load(model: str | None, threads: int | None, stop: Any) -> None:
    """A neighbour engine: prefill and decode, over and over, until `stop` is set."""
    timer = _Timer(model, threads, 2048, 16)
    while not stop.is_set():
        timer._add(4, 512, 32)
        timer._drain()


@contextlib.contextmanager
def colocated_load(count: int, model: str | None, threads: int | None) -> Iterator[None]:
    """`count` neighbour engines in their own processes for the duration of the block."""
    if count < 1:
        yield
        return
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    procs = [ctx.Process(target=_steady_load, args=(model, threads, stop), daemon=True)
             for _ in range(count)]
    for proc in procs:
        proc.start()
    time.sleep(5.0)  # let them load their model and reach a steady state
    try:
        yield
    finally:
        stop.set()
        for proc in procs:
            proc.join(30.0)
            if proc.is_alive():
                proc.kill()
