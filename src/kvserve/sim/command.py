"""`kvserve simulate`: replay a workload through a simulated fleet, policies side by side."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from kvserve.gateway.core.pipeline import parse_policy_options, split_policy_spec
from kvserve.gateway.core.queue_wait import DEFAULT_MAX_QUEUE_WAIT_S
from kvserve.sim.adapters import AdapterSpec
from kvserve.sim.client import ClientConfig
from kvserve.sim.fleet import SIMULATED_POLICIES, SimConfig
from kvserve.sim.gateway import Backpressure
from kvserve.sim.metrics import SimResult
from kvserve.sim.profiles import PROFILE_NAMES, load_profile
from kvserve.sim.report import results_table, write_json
from kvserve.sim.runner import SimTask, run_tasks
from kvserve.sim.worker import WorkerConfig
from kvserve.sim.workload import MULTI_TENANT, Workload, load_workload
from kvserve.workload import MultiTenantSpec, TraceFormatError

VARIANTS = {  # --clients: (retrying clients, gateway backpressure)
    "patient": (False, False),
    "retry": (True, False),
    "retry-bp": (True, True),
    "patient-bp": (False, True),
}


def _pair(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    return int(low), int(high or low)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("simulate", help="simulate a fleet: real KV cache, real routing policies",
                       description=__doc__)
    w = p.add_argument_group("workload")
    w.add_argument("--trace", required=True,
                   help=f"a Mooncake .jsonl or Azure .csv trace, or '{MULTI_TENANT}'")
    w.add_argument("--limit", type=int, default=None, help="only the first K requests")
    w.add_argument("--rate-scale", type=float, default=1.0,
                   help="compress arrival times by this factor (more load)")
    w.add_argument("--tenants", type=int, default=8, help=f"{MULTI_TENANT}: tenants")
    w.add_argument("--requests", type=int, default=2000, help=f"{MULTI_TENANT}: requests")
    w.add_argument("--rate", type=float, default=4.0, help=f"{MULTI_TENANT}: arrivals per s")
    w.add_argument("--skew", type=float, default=1.0, help=f"{MULTI_TENANT}: Zipf skew")
    w.add_argument("--prefix-tokens", type=_pair, default=(25_000, 30_000), metavar="LO,HI",
                   help=f"{MULTI_TENANT}: tenant prefix length range")
    w.add_argument("--suffix-tokens", type=_pair, default=(200, 1_000), metavar="LO,HI",
                   help=f"{MULTI_TENANT}: unique suffix length range")
    w.add_argument("--output-tokens", type=int, default=120, help=f"{MULTI_TENANT}: answers")
    w.add_argument("--seed", type=int, default=0)
    f = p.add_argument_group("fleet")
    f.add_argument("--workers", type=int, default=4)
    f.add_argument("--policy", default="round_robin,prefix_hash,cache_aware",
                   help=f"comma-separated, from: {', '.join(SIMULATED_POLICIES)}; a policy may "
                        "carry options, POLICY@KEY=VALUE[@KEY=VALUE] (e.g. "
                        "cache_aware@backlog_weight=0), to run variants side by side")
    f.add_argument("--profile", default="h100",
                   help=f"cost profile: {', '.join(PROFILE_NAMES)} or a JSON file")
    f.add_argument("--capacity-tokens", type=int, default=None,
                   help="KV cache per worker, tokens (default: the profile's)")
    f.add_argument("--block-size", type=int, default=16, help="KV block size, tokens")
    f.add_argument("--max-num-batched-tokens", type=int, default=None)
    f.add_argument("--max-num-seqs", type=int, default=None)
    f.add_argument("--max-model-len", type=int, default=None)
    f.add_argument("--scrape-interval", type=float, default=1.0,
                   help="seconds between the gateway's scrapes of worker metrics (staleness)")
    f.add_argument("--adapters", type=int, default=0, metavar="N",
                   help="LoRA adapters over the tenants (the k-th tenant runs adapter k mod "
                        "N); 0: none. Reports adapter loads per request")
    f.add_argument("--max-loras", type=int, default=2,
                   help="with --adapters: adapters a worker runs in one batch (its slots)")
    f.add_argument("--adapter-load-ms", type=float, default=50.0,
                   help="with --adapters: time to load an adapter into a slot")
    f.add_argument("--route-block-tokens", type=int, default=64,
                   help="the gateway's prefix block (~ its 256-character text blocks)")
    c = p.add_argument_group("clients and backpressure")
    c.add_argument("--retries", action="store_true",
                   help="clients cancel and resend after --ttft-timeout without a first token")
    c.add_argument("--ttft-timeout", type=float, default=5.0)
    c.add_argument("--max-retries", type=int, default=3)
    c.add_argument("--backpressure", action="store_true",
                   help="gateway admission limit: 429 + Retry-After, which clients honour")
    c.add_argument("--clients", default=None, metavar="V1,V2",
                   help=f"run every policy once per client variant: {', '.join(VARIANTS)} "
                        "(overrides --retries/--backpressure)")
    c.add_argument("--max-in-flight", type=int, default=256)
    c.add_argument("--max-queued", type=int, default=512)
    c.add_argument("--queue-timeout", type=float, default=1.0,
                   help="seconds a client that says no timeout waits for a slot")
    c.add_argument("--max-queue-wait", type=float, default=DEFAULT_MAX_QUEUE_WAIT_S,
                   help="a client with --ttft-timeout says it and waits for a slot while "
                        "it can still be answered in time (gateway.queue_wait), at most this "
                        "many seconds")
    c.add_argument("--retry-after", type=int, default=1, metavar="S",
                   help="the Retry-After of the gateway's 429s, whole seconds")
    c.add_argument("--latency-limit", action=argparse.BooleanOptionalAction, default=True,
                   help="the gateway's AIMD admission limit, cut by late first tokens "
                        "(with --backpressure; it applies only with --undeclared-batch)")
    c.add_argument("--undeclared-batch", action="store_true",
                   help="model workers that do not declare their batch (vLLM, SGLang), for "
                        "which the gateway's latency limit applies; by default they declare "
                        "it, as kvserve workers do")
    c.add_argument("--seniority", action=argparse.BooleanOptionalAction, default=True,
                   help="queue a resend in the place of its request's first send, as the "
                        "gateway does (with --backpressure)")
    c.add_argument("--slo", type=float, default=5.0, help="TTFT objective for 'TTFT≤SLO', s")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, default=None,
                   help="directory for results.json and the PNG plots")
    o.add_argument("--plot", type=Path, default=None, metavar="DIR",
                   help="directory for the PNG plots alone (hit rate over time by policy, "
                        "TTFT CDF, load per worker)")
    o.add_argument("--jobs", type=int, default=0,
                   help="runs at once in separate processes (0: up to two per CPU)")
    o.add_argument("--json", action="store_true", help="print the summaries as JSON")
    p.set_defaults(func=run)


def build_tasks(args: argparse.Namespace) -> list[SimTask]:
    """One task per (policy, client variant); raises ValueError for bad settings."""
    profile = load_profile(args.profile)
    capacity = args.capacity_tokens or profile.kv_capacity_tokens
    if args.block_size < 1 or capacity < args.block_size:
        raise ValueError("--block-size must be >= 1 and --capacity-tokens at least one block")
    worker = WorkerConfig(
        num_blocks=capacity // args.block_size, block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens or profile.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs or profile.max_num_seqs,
        max_model_len=args.max_model_len)
    adapters = (AdapterSpec(args.adapters, args.max_loras, args.adapter_load_ms / 1000.0)
                if args.adapters > 0 else None)
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    if args.clients:
        variants = [v.strip() for v in args.clients.split(",")]
        unknown = [v for v in variants if v not in VARIANTS]
        if unknown:
            raise ValueError(f"unknown --clients {', '.join(unknown)}; use {', '.join(VARIANTS)}")
    else:
        variants = [next(k for k, v in VARIANTS.items()
                         if v == (args.retries, args.backpressure))]
    tasks = []
    for variant in variants:
        retrying, throttled = VARIANTS[variant]
        client = (ClientConfig.retrying(args.ttft_timeout, args.max_retries) if retrying
                  else ClientConfig())
        backpressure = (Backpressure(args.max_in_flight, args.max_queued, args.queue_timeout,
                                     args.retry_after, args.latency_limit, args.seniority,
                                     args.max_queue_wait,
                                     declared_batch=not args.undeclared_batch)
                        if throttled else None)
        for spec in policies:
            policy, option_specs = split_policy_spec(spec)
            config = SimConfig(
                num_workers=args.workers, worker=worker, profile=profile, policy=policy,
                policy_options=parse_policy_options(option_specs),
                client=client, backpressure=backpressure,
                scrape_interval_s=args.scrape_interval,
                route_block_tokens=args.route_block_tokens, slo_s=args.slo, seed=args.seed,
                adapters=adapters)
            config.make_policy()  # an unknown or out-of-range option fails before any run
            label = f"{spec} [{variant}]" if args.clients else spec
            tasks.append(SimTask(label, config))
    return tasks


def _workload(args: argparse.Namespace) -> Workload:
    spec = MultiTenantSpec(
        num_tenants=args.tenants, num_requests=args.requests, prefix_tokens=args.prefix_tokens,
        suffix_tokens=args.suffix_tokens, output_tokens=args.output_tokens, rate_per_s=args.rate,
        skew=args.skew, seed=args.seed)
    return load_workload(args.trace, limit=args.limit, rate_scale=args.rate_scale, spec=spec)


def run(args: argparse.Namespace) -> int:
    err = Console(stderr=True)
    try:
        workload = _workload(args)
        tasks = build_tasks(args)
    except (TraceFormatError, ValueError) as exc:
        err.print(f"[red]{exc}[/]", soft_wrap=True)
        return 2
    if not workload.requests:
        err.print("[red]the workload has no requests[/]")
        return 2
    # Runs are CPU-bound and equal-sized: a little oversubscription avoids an idle tail.
    jobs = args.jobs or min(len(tasks), 2 * (os.cpu_count() or 1))
    started = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(),
                  TextColumn("{task.completed:.0f}/{task.total:.0f}"), TimeElapsedColumn(),
                  console=err, transient=False) as bar:
        total = len(workload.requests)
        ids: list[TaskID] = [bar.add_task(escape(t.label), total=total) for t in tasks]

        def progress(idx: int, done: int, total: int) -> None:
            bar.update(ids[idx], completed=done, total=total)

        results = run_tasks(tasks, workload, jobs, progress)
    wall = time.perf_counter() - started
    first = tasks[0].config
    title = (f"{workload.name}: {len(workload.requests)} requests over "
             f"{workload.duration_s:.0f} s, {first.num_workers} workers, profile "
             f"{first.profile.name}, {first.worker.num_blocks * first.worker.block_size} "
             f"KV tokens/worker (block {first.worker.block_size})")
    out = Console(width=None if sys.stdout.isatty() else 200)
    out.print(results_table(results, title))
    out.print(f"wall time {wall:.1f} s ({jobs} process{'es' if jobs > 1 else ''})")
    if args.json:
        print(json.dumps([r.summary() for r in results], indent=1))
    if args.out is not None:
        _write_outputs(results, args, title, wall, out)
    if args.plot is not None:
        _write_plots(results, args.plot, title, out)
    if args.out is None and args.plot is None and not args.json:
        err.print("(--out DIR writes results.json and the PNG plots, --plot DIR the plots)")
    return 0 if all(r.audit_ok for r in results) else 1


def _write_outputs(results: list[SimResult], args: argparse.Namespace, title: str,
                   wall: float, out: Console) -> None:

    meta: dict[str, Any] = {k: (str(v) if isinstance(v, Path) else v)
                            for k, v in vars(args).items() if k != "func"}
    meta.update(title=title, wall_s=wall)
    json_path = args.out / "results.json"
    write_json(results, json_path, meta)
    out.print(f"wrote {json_path}", soft_wrap=True)
    _write_plots(results, args.out, title, out)


def _write_plots(results: list[SimResult], out_dir: Path, title: str, out: Console) -> None:
    from kvserve.sim.plots import write_plots

    try:
        paths = write_plots(results, out_dir, title.split(":")[0])
    except ImportError:
        out.print("no plots: matplotlib is not installed (pip install 'kvserve[plot]')",
                  markup=False, soft_wrap=True)
        return
    out.print(f"wrote {', '.join(str(p) for p in paths)}", soft_wrap=True)
