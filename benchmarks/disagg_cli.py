"""`python -m benchmarks disagg`: ongoing decodes beside periodic long prompts, unified vs
disaggregated.

Two fleets with the same total compute threads, one after the other (never sharing the CPU):
unified, two `--role both` workers behind the gateway (prefix_hash); disaggregated, one
`--role prefill` and one `--role decode` worker behind the gateway's disaggregated mode. Each
gets an untimed warm-up, then the same timed mix (disagg_load.py). Reported: ITL p50/p99 of the
decoding requests, TTFT of the long prompts, and what the KV transfer cost (the decode worker's
own counters: ms per block and per token, bytes per second of the stream).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import secrets
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from benchmarks.disagg_load import MixResult, MixSpec, run_mix
from kvserve.bench.gateway_fleet import KvserveGateway
from kvserve.bench.serve_load import percentile
from kvserve.bench.server_launch import KVSERVE, LaunchedServer, LaunchError, LaunchSpec

UNIFIED = "unified"
DISAGGREGATED = "disaggregated"
MODES = (UNIFIED, DISAGGREGATED)
TRANSFER_METRICS = ("kvserve:kv_transfer_blocks_received_total",
                    "kvserve:kv_transfer_bytes_received_total",
                    "kvserve:kv_transfer_seconds_sum", "kvserve:kv_transfer_seconds_count",
                    "kvserve:kv_transfer_skipped_blocks_total",
                    "kvserve:kv_transfer_failures_total")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("disagg", help="decode ITL beside long prompts: unified vs "
                                      "disaggregated prefill/decode")
    p.add_argument("--model", default="tiny", help="tiny, 100m or a checkpoint dir")
    p.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    p.add_argument("--num-decoders", type=int, default=4, help="concurrent decoding clients")
    p.add_argument("--decode-prompt-len", type=int, default=32)
    p.add_argument("--decode-output-len", type=int, default=128)
    p.add_argument("--long-prompt-len", type=int, default=2048)
    p.add_argument("--long-output-len", type=int, default=4)
    p.add_argument("--long-every", type=float, default=1.0, help="seconds between long prompts")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of the timed mix")
    p.add_argument("--warmup", type=float, default=4.0, help="seconds of untimed mix first")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("launched workers (the same for every worker)")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    g.add_argument("--decode-host-tier-bytes", type=int, default=256 << 20,
                   help="the decode worker's host tier, which receives the KV")
    g.add_argument("--max-model-len", type=int, default=4096)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--threads-per-worker", type=int, default=1)
    g.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--json", action="store_true", help="one JSON object per mode")
    p.set_defaults(func=run)


@dataclass(frozen=True, slots=True)
class ModeRun:
    """One fleet's figures (milliseconds, bytes, counts)."""

    mode: str
    itl_p50_ms: float
    itl_p99_ms: float
    itl_p999_ms: float
    itl_max_ms: float
    itl_samples: int
    long_ttft_p50_ms: float
    long_ttft_p99_ms: float
    long_prompts: int
    decode_tokens_per_s: float
    failed: int
    transfer_blocks: float = 0.0
    transfer_bytes: float = 0.0
    transfer_ms_per_block: float = float("nan")
    transfer_ms_per_token: float = float("nan")
    transfer_mb_per_s: float = float("nan")
    transfer_failures: float = 0.0


def _scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in TRANSFER_METRICS:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


@contextlib.contextmanager
def _fleet(mode: str, spec: LaunchSpec, args: argparse.Namespace,
           log_dir: Path) -> Iterator[tuple[str, str | None]]:
    """The gateway's URL (and the decode worker's, when disaggregated), fleet up and healthy."""
    key = secrets.token_hex(8)
    roles: list[tuple[str, ...]]
    if mode == UNIFIED:
        roles = [(), ()]
    else:
        roles = [("--role", "prefill", "--admin-key", key),
                 ("--role", "decode", "--admin-key", key, "--kv-host-tier-bytes",
                  str(args.decode_host_tier_bytes))]
    workers = [LaunchedServer(KVSERVE, replace(spec, extra_args=r), log_dir,
                              args.startup_timeout) for r in roles]
    gateway = None
    try:
        for worker in workers:
            worker.launch()
        for worker in workers:
            worker.wait_healthy()
        urls = [w.url for w in workers]
        if mode == UNIFIED:
            gateway = KvserveGateway("prefix_hash", urls, log_dir)
        else:
            gateway = KvserveGateway("prefix_hash", [], log_dir, [
                "--prefill-worker", urls[0], "--decode-worker", urls[1], "--admin-key", key])
        gateway.start()
        yield gateway.url, (urls[1] if mode == DISAGGREGATED else None)
    finally:
        if gateway is not None:
            gateway.stop()
        for worker in workers:
            worker.stop()


def measure(mode: str, spec: LaunchSpec, mix: MixSpec, args: argparse.Namespace,
            log_dir: Path) -> ModeRun:
    with _fleet(mode, spec, args, log_dir) as (url, decode_url):
        asyncio.run(run_mix(url, spec.served_model_name,
                            replace(mix, duration_s=args.warmup), "warmup"))
        before = _scrape(decode_url) if decode_url else {}
        result: MixResult = asyncio.run(run_mix(url, spec.served_model_name, mix, "timed"))
        after = _scrape(decode_url) if decode_url else {}
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in TRANSFER_METRICS}
    itl = result.itl_s
    run_ = ModeRun(mode, 1000 * percentile(itl, 50), 1000 * percentile(itl, 99),
                   1000 * percentile(itl, 99.9), 1000 * max(itl, default=float("nan")),
                   len(itl), 1000 * percentile(result.long_ttft_s, 50),
                   1000 * percentile(result.long_ttft_s, 99), len(result.long_ttft_s),
                   result.num_decode_tokens / result.wall_s, result.num_failed)
    blocks, seconds = delta["kvserve:kv_transfer_blocks_received_total"], \
        delta["kvserve:kv_transfer_seconds_sum"]
    if not blocks:
        return run_
    block_size = spec.block_size or 16
    return replace(run_, transfer_blocks=blocks,
                   transfer_bytes=delta["kvserve:kv_transfer_bytes_received_total"],
                   transfer_ms_per_block=1000 * seconds / blocks,
                   transfer_ms_per_token=1000 * seconds / blocks / block_size,
                   transfer_mb_per_s=delta["kvserve:kv_transfer_bytes_received_total"]
                   / seconds / 1e6 if seconds else float("nan"),
                   transfer_failures=delta["kvserve:kv_transfer_failures_total"])


def _table(rows: list[ModeRun]) -> Table:
    table = Table(title="decodes beside long prompts (ms)")
    for col in ("mode", "ITL p50", "ITL p99", "ITL p99.9", "ITL max", "ITL n",
                "long TTFT p50", "long TTFT p99",
                "long n", "decode tok/s", "failed", "KV blocks", "ms/block", "ms/token",
                "MB/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r.mode, f"{r.itl_p50_ms:.1f}", f"{r.itl_p99_ms:.1f}",
                      f"{r.itl_p999_ms:.1f}", f"{r.itl_max_ms:.0f}", str(r.itl_samples),
                      f"{r.long_ttft_p50_ms:.0f}", f"{r.long_ttft_p99_ms:.0f}",
                      str(r.long_prompts), f"{r.decode_tokens_per_s:.0f}", str(r.failed),
                      f"{r.transfer_blocks:.0f}", f"{r.transfer_ms_per_block:.3f}",
                      f"{r.transfer_ms_per_token:.4f}", f"{r.transfer_mb_per_s:.0f}")
    return table


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    try:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        if not modes or set(modes) - set(MODES):
            raise ValueError(f"--modes {args.modes!r}: choose from {', '.join(MODES)}")
        from kvserve.bench.engine_workloads import ensure_bench_model

        model_dir = ensure_bench_model(args.model)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        mix = MixSpec(args.num_decoders, args.decode_prompt_len, args.decode_output_len,
                      args.long_prompt_len, args.long_output_len, args.long_every,
                      args.duration, vocab, args.seed)
        mix.check()
        if args.long_prompt_len + args.long_output_len > args.max_model_len:
            raise ValueError("--long-prompt-len + --long-output-len exceeds --max-model-len")
    except ValueError as exc:
        console.print(f"[red]{exc}[/]", soft_wrap=True)
        return 2
    spec = LaunchSpec(model_dir=model_dir.resolve(), served_model_name=model_dir.name,
                      kv_cache_bytes=args.kv_cache_memory_bytes,
                      max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      num_threads=args.threads_per_worker)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-disagg-") as tmp:
        for mode in modes:
            console.print(f"[bold]{mode}[/]: warm-up {args.warmup:.0f} s, then "
                          f"{args.duration:.0f} s timed", soft_wrap=True)
            try:
                rows.append(measure(mode, spec, mix, args, Path(tmp)))
            except LaunchError as exc:
                console.print(f"[red]{mode}: {exc}[/]", soft_wrap=True)
                return 1
    if args.json:
        for row in rows:
            print(json.dumps(asdict(row) | {"spec": asdict(mix)}))
    else:
        Console(width=200).print(_table(rows))
    return 0

