"""`kvserve bench kvcache`: trace replay through kvserve's cache and, side by side, vLLM's."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvserve.bench.kvcache_replay import ReplayResult, replay_trace
from kvserve.bench.peers_env import peer_driver, vllm_python, vllm_unavailable
from kvserve.workload import (
    MultiTenantSpec,
    TraceFormatError,
    TraceRequest,
    load_trace,
    multi_tenant_trace,
    write_mooncake_trace,
)

MULTI_TENANT = "multi-tenant"
DRIVER = peer_driver("vllm_kvcache_driver.py")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("kvcache", help="replay a trace through the KV cache (hit rate, ops/s)")
    p.add_argument("--trace", required=True,
                   help=f"a Mooncake .jsonl or Azure .csv trace, or '{MULTI_TENANT}' (synthetic)")
    p.add_argument("--capacity-tokens", required=True, type=int, nargs="+", metavar="N",
                   help="cache capacity in tokens; several values replay once each")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first K requests")
    p.add_argument("--tenants", type=int, default=8, help=f"{MULTI_TENANT}: number of tenants")
    p.add_argument("--requests", type=int, default=2000, help=f"{MULTI_TENANT}: requests")
    p.add_argument("--skew", type=float, default=1.0, help=f"{MULTI_TENANT}: Zipf skew of tenants")
    p.add_argument("--peer", choices=["auto", "vllm", "none"], default="auto",
                   help="measure vLLM's KV cache manager in the same run (auto: when installed)")
    p.add_argument("--json", action="store_true", help="print one JSON object per capacity")
    p.set_defaults(func=run)


def load_requests(args: argparse.Namespace) -> list[TraceRequest]:
    if args.trace == MULTI_TENANT:
        spec = MultiTenantSpec(num_tenants=args.tenants, num_requests=args.requests, skew=args.skew)
        return multi_tenant_trace(spec)[: args.limit]
    return load_trace(args.trace, args.limit)


def run_vllm(trace_path: Path, capacity: int, args: argparse.Namespace) -> dict[str, object]:
    python = vllm_python()
    assert python is not None
    cmd = [str(python), str(DRIVER), "--trace", str(trace_path), "--capacity-tokens",
           str(capacity), "--block-size", str(args.block_size)]
    if args.limit is not None:
        cmd += ["--limit", str(args.limit)]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM driver failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run(args: argparse.Namespace) -> int:
    err = Console(stderr=True)
    if args.block_size < 1 or min(args.capacity_tokens) < args.block_size:
        err.print("[red]--block-size must be >= 1 and each --capacity-tokens at least one block[/]",
                  soft_wrap=True)
        return 2
    try:
        requests = load_requests(args)
    except TraceFormatError as exc:
        err.print(f"[red]{exc}[/]", soft_wrap=True)
        return 2
    unavailable = vllm_unavailable(DRIVER)
    use_vllm = args.peer == "vllm" or (args.peer == "auto" and unavailable is None)
    if args.peer == "vllm" and unavailable is not None:
        err.print(f"[red]{unavailable}[/]", soft_wrap=True)
        return 2
    if args.peer == "auto" and not use_vllm:
        err.print(f"[yellow]{unavailable}[/]", soft_wrap=True)

    rows: list[tuple[ReplayResult, dict[str, object] | None]] = []
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = Path(tmp) / "trace.jsonl"
        if use_vllm:
            write_mooncake_trace(requests, trace_path)
        for capacity in args.capacity_tokens:
            ours = replay_trace(requests, capacity, args.block_size)
            peer = run_vllm(trace_path, capacity, args) if use_vllm else None
            rows.append((ours, peer))
            if args.json:
                out = ours.as_dict() | {"trace": args.trace}
                if peer is not None:
                    out["vllm"] = peer
                    out["ops_per_s_ratio_vs_vllm"] = ours.ops_per_s / float(peer["ops_per_s"])
                print(json.dumps(out), flush=True)
    if not args.json:
        print_table(args.trace, rows)
    return 0


def print_table(trace: str, rows: list[tuple[ReplayResult, dict[str, object] | None]]) -> None:
    table = Table(title=f"kvcache replay: {trace}")
    for col in ("capacity", "block", "hit rate", "ops/s", "rejected", "evicted",
                "vLLM hit", "vLLM ops/s", "ratio"):
        table.add_column(col, justify="right")
    for ours, peer in rows:
        peer_cells = ["-", "-", "-"]
        if peer is not None:
            peer_ops = float(peer["ops_per_s"])  # type: ignore[arg-type]
            peer_cells = [f"{float(peer['hit_rate']):.4f}", f"{peer_ops:,.0f}",  # type: ignore[arg-type]
                          f"{ours.ops_per_s / peer_ops:.2f}x"]
        table.add_row(f"{ours.capacity_tokens:,}", str(ours.block_size), f"{ours.hit_rate:.4f}",
                      f"{ours.ops_per_s:,.0f}", str(ours.rejected), f"{ours.evicted_blocks:,}",
                      *peer_cells)
    # Off a terminal (pipes, CI logs) rich would wrap at 80 columns; a table reads better whole.
    Console(width=None if sys.stdout.isatty() else 140).print(table)
    sys.stdout.flush()
