"""`python -m benchmarks server-path`: what the server path adds per token at concurrency 1.

The same prompts (`--input-len` tokens, `--output-len` out, greedy, EOS ignored) run one at a time
through (a) the offline engine (`LLMEngine.step()` until the request finishes) in a process of
its own and (b) a launched `kvserve serve` with the same engine arguments, streamed over HTTP.
For each, per repeat: the ITL (wall time between consecutive tokens, mean over the decode of every
prompt) and the CPU time per decoded token (user + system of the whole process, every thread,
between the first token and the last, divided by the tokens in between), and the voluntary context
switches per token of all its threads (a thread that sleeps and is woken again: an OpenMP worker
waiting in the kernel between parallel regions shows here). CPU time is the steadier figure on a
shared machine: another process running meanwhile stretches wall time but not this process's CPU.
Repeats alternate between the sides, so both see the same moments' load, and the summary gives the
median of each repeat's server / offline ratio: short repeats (few prompts, many repeats)
follow the VM's drift most closely.

`--instances N` starts N such pairs of processes one after the other (a fresh server and a fresh
offline process each, `--repeats` interleaved repeats in each): on a VM one engine can be 5-12%
faster than an identical one built elsewhere in memory (benchmarks/server_path_offline.py), so
one pair measures placement as much as the server path. The summary gives each instance's
medians and, over all of them, the median pair ratio and the ratio of the sides' medians of
instance medians.

The server side's client shares the machine: its CPU per token (this thread's, first text to
end) is reported beside the server's, since on 2 cores every millisecond it spends is one the
server's compute threads lose. `--client socket` (the default) reads the stream with one `recv`
per arrival (benchmarks/sse_reader.py); `--client httpx` is the async line iterator with a JSON
parse per chunk, as `kvserve bench serve` reads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks.server_path_offline import (
    KV_CACHE_BYTES,
    MAX_MODEL_LEN,
    WARMUP_PROMPT,
    OfflineSide,
    quantization,
    worker_main,
)
from benchmarks.server_path_readings import Reading, Sample, make_sample, proc_reading
from benchmarks.sse_reader import stream_completion


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("server-path",
                       help="offline ITL against server ITL at concurrency 1 (wall and CPU)")
    p.add_argument("--model", required=True,
                   help="checkpoint dir (tiny / 100m: bench models), or a .gguf file (both sides "
                        "then keep its blocks packed: --quantization gguf)")
    p.add_argument("--side", choices=["offline", "server", "both"], default="both")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per repeat")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3,
                   help="timed repeats per side and instance")
    p.add_argument("--instances", type=int, default=1,
                   help="pairs of fresh processes (a server, an offline engine), one after the "
                        "other (see the module docstring)")
    p.add_argument("--offline-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the model's dtype, on both sides")
    p.add_argument("--client", choices=["socket", "httpx"], default="socket",
                   help="how the server side reads its stream (see the module docstring)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="extra `kvserve serve` argument (repeatable, e.g. --serve-arg=--flag)")
    p.set_defaults(func=run)


class ServerSide:
    """A launched `kvserve serve` with the offline side's engine arguments, streamed from.

    Each request gives (the server's readings from the first chunk with text to the last chunk,
    tokens after the first): tokens from the usage chunk, since the detokenizer may hold a
    token's text back and send it with the next one (`kvserve bench serve`'s TPOT). The
    server's /proc is read at the first text chunk and at the stream's end only; in between
    just the clock is read, since reading every thread's files at each chunk costs the client
    a core's share the server's threads then miss (2-core machines)."""

    name = "server"

    def __init__(self, model_dir: Path, threads: int, output_len: int, log_dir: Path,
                 extra: Sequence[str], client: str, instance: int) -> None:
        from kvserve.bench.server_launch import LaunchedServer, LaunchSpec

        self.spec = LaunchSpec(model_dir=model_dir.resolve(), served_model_name=model_dir.name,
                               kv_cache_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN,
                               max_num_seqs=64, max_num_batched_tokens=2048,
                               num_threads=threads, extra_args=tuple(extra))
        self.output_len = output_len
        self.client = client
        self.instance = instance
        self.server = LaunchedServer("kvserve", self.spec, log_dir, 600.0)
        self.server.start()
        assert self.server.pid is not None
        self.pid = self.server.pid
        self._stream([WARMUP_PROMPT])

    def close(self) -> None:
        self.server.stop()

    def run(self, repeat: int, prompts: Sequence[str]) -> Sample:
        results = self._stream(prompts)
        return make_sample(self.name, repeat, [(r, n) for r, n, _ in results],
                           sum(c for _, _, c in results), self.instance)

    def _stream(self, prompts: Sequence[str]) -> list[tuple[Reading, int, float]]:
        from kvserve.bench.serve_load import completion_body

        bodies = [completion_body(self.spec.served_model_name, p, self.output_len)
                  for p in prompts]
        if self.client == "socket":
            return [self._one_socket(body) for body in bodies]
        return asyncio.run(self._httpx(bodies))

    def _one_socket(self, body: dict[str, Any]) -> tuple[Reading, int, float]:
        readings: list[Reading] = []
        times = stream_completion(self.server.url, body,
                                  lambda: readings.append(proc_reading(self.pid)))
        end = proc_reading(self.pid)
        (first,) = readings
        return (Reading(times.last_choice - times.first_text, end.cpu_s - first.cpu_s,
                        end.switches - first.switches), times.completion_tokens - 1,
                times.client_cpu_s)

    async def _httpx(self, bodies: Sequence[dict[str, Any]]) -> list[tuple[Reading, int, float]]:
        async with httpx.AsyncClient(timeout=600.0) as client:
            return [await self._one_httpx(client, body) for body in bodies]

    async def _one_httpx(self, client: httpx.AsyncClient,
                         body: dict[str, Any]) -> tuple[Reading, int, float]:
        first: Reading | None = None
        last_wall = cpu_start = 0.0
        num_tokens = 0
        async with client.stream("POST", f"{self.server.url}/v1/completions",
                                 json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                num_tokens = int((chunk.get("usage") or {}).get("completion_tokens") or
                                 num_tokens)
                choices = chunk.get("choices") or ()
                if choices and (first is not None or any(c.get("text") for c in choices)):
                    last_wall = time.perf_counter()
                    if first is None:
                        first, cpu_start = proc_reading(self.pid), time.thread_time()
        assert first is not None and num_tokens, "the stream carried no text or no usage"
        client_cpu_s = time.thread_time() - cpu_start
        end = proc_reading(self.pid)
        return (Reading(last_wall - first.wall, end.cpu_s - first.cpu_s,
                        end.switches - first.switches), num_tokens - 1, client_cpu_s)


def run(args: argparse.Namespace) -> int:
    from kvserve.bench.engine_workloads import ensure_bench_model

    model_dir = (Path(args.model) if args.model.endswith(".gguf")
                 else ensure_bench_model(args.model))
    if args.offline_worker:
        return worker_main(model_dir, args.threads, args.output_len, args.dtype)
    if args.instances < 1 or args.repeats < 1:
        raise SystemExit("server-path: --instances and --repeats must be at least 1")
    from kvserve.bench.serve_prompts import PromptBuilder, PromptSpec
    from kvserve.model import Tokenizer

    builder = PromptBuilder(Tokenizer.from_pretrained(model_dir))
    spec = PromptSpec(args.num_prompts, args.input_len, 0.0)
    samples: list[Sample] = []
    with tempfile.TemporaryDirectory(prefix="kvserve-server-path-") as tmp:
        for instance in range(args.instances):
            samples += _run_instance(args, model_dir, Path(tmp), instance, builder, spec)
    _summarize(args, samples)
    return 0


def _run_instance(args: argparse.Namespace, model_dir: Path, tmp: Path, instance: int,
                  builder: Any, spec: Any) -> list[Sample]:
    """One pair of fresh processes, `--repeats` repeats interleaved between them."""
    samples: list[Sample] = []
    sides: list[OfflineSide | ServerSide] = []
    try:
        if args.side in ("offline", "both"):
            sides.append(OfflineSide(model_dir, args.threads, args.output_len, args.dtype,
                                     instance))
        if args.side in ("server", "both"):
            log_dir = tmp / f"instance-{instance}"
            log_dir.mkdir()
            sides.append(ServerSide(model_dir, args.threads, args.output_len, log_dir,
                                    ["--dtype", args.dtype, *_quantization_args(model_dir),
                                     *args.serve_arg], args.client,
                                    instance))
        for r in range(args.repeats):  # interleaved: both see the same moments' load
            repeat = instance * args.repeats + r
            prompts = builder.build(spec, f"server-path/{repeat}")
            for side in sides:
                samples.append(side.run(repeat, prompts))
                print(json.dumps(samples[-1].row()), flush=True)
    finally:
        for side in sides:
            side.close()
    return samples


def _quantization_args(model: Path) -> list[str]:
    mode = quantization(model)
    return [] if mode is None else ["--quantization", mode]


def _summarize(args: argparse.Namespace, samples: Sequence[Sample]) -> None:
    for name in ("offline", "server"):
        mine = [s for s in samples if s.side == name]
        if not mine:
            continue
        itl = [s.itl_ms for s in mine]
        cpu = [s.cpu_ms_per_token for s in mine]
        switches = [s.switches_per_token for s in mine]
        clients = [s.client_cpu_ms_per_token for s in mine
                   if s.client_cpu_ms_per_token is not None]
        client = (f"; client CPU ms/token {statistics.median(clients):.3f} ({args.client})"
                  if clients else "")
        print(f"{name:8s} ITL ms: median {statistics.median(itl):6.2f} "
              f"(min {min(itl):.2f}, max {max(itl):.2f}); CPU ms/token: median "
              f"{statistics.median(cpu):6.2f} (min {min(cpu):.2f}, max {max(cpu):.2f}); "
              f"switches/token {statistics.median(switches):.1f}{client}; "
              f"{len(mine)} repeats x {mine[0].tokens} tokens; load average "
              f"{os.getloadavg()[0]:.1f}")
    by_instance = _instance_medians(samples)
    if args.instances > 1:
        for name, medians in by_instance.items():
            print(f"{name:8s} ITL ms, median of each instance: "
                  + " ".join(f"{m:.2f}" for m in medians))
    pairs = _pair_ratios(samples)
    if pairs:
        print("server / offline ITL, per interleaved repeat: median "
              f"{statistics.median(pairs):.3f} (min {min(pairs):.3f}, max {max(pairs):.3f}; "
              f"{len(pairs)} pairs)")
    if args.instances > 1 and len(by_instance) == 2:
        ratio = (statistics.median(by_instance["server"])
                 / statistics.median(by_instance["offline"]))
        print(f"server / offline ITL, median of instance medians: {ratio:.3f} "
              f"({args.instances} instances)")


def _instance_medians(samples: Sequence[Sample]) -> dict[str, list[float]]:
    """Each side's median ITL in each instance, in instance order."""
    out: dict[str, list[float]] = {}
    for name in ("offline", "server"):
        instances = sorted({s.instance for s in samples if s.side == name})
        if instances:
            out[name] = [statistics.median(s.itl_ms for s in samples
                                           if s.side == name and s.instance == i)
                         for i in instances]
    return out


def _pair_ratios(samples: Sequence[Sample]) -> list[float]:
    """server ITL / offline ITL of each repeat both sides ran. Each pair ran back to back, so
    the ratio is steadier than a ratio of medians on a VM whose speed drifts over seconds."""
    offline = {s.repeat: s.itl_ms for s in samples if s.side == "offline"}
    return [s.itl_ms / offline[s.repeat] for s in samples
            if s.side == "server" and s.repeat in offline]
