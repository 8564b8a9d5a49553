"""`python -m benchmarks gateway`: routers side by side on one local fleet, multi-tenant traffic.

One fleet of workers (kvserve's, or vLLM's CPU server with `--worker-server vllm`) is started;
for every case and router it is made cold again, the router's processes are started, the same
open-loop multi-tenant workload is sent (gateway_load.py), and the workers' own prefix-cache
counters give the fleet hit rate. Routers: kvserve's gateway (`kvserve:POLICY`), SGLang's router
(`sglang:POLICY`, docs/peers.md), and `ideal`, the client-side split that pins each tenant
to one worker (the hit-rate ceiling). Cases (production's, per the gateway issue):

- base: one router replica, even tenant mix, patient clients;
- replicas2 / replicas4: that many router replicas behind a plain round-robin balancer (the
  clients rotate over the replicas' URLs, as an L4 balancer would);
- skew: a Zipf-skewed tenant mix (one hot tenant);
- overload: `--overload` times the arrival rate, clients that give up on a first token after
  `--ttft-timeout` seconds and resend (the retry storm);
- failover: worker 1 is killed a third of the way through the arrivals and restarted at two
  thirds; clients resend failed requests;
- overhead: added latency and maximum requests/s against a direct connection
  (gateway_overhead.py).

The working set (shared prefixes) is sized against one worker's KV cache (`--working-set`,
default 1.5x one worker, so 0.75x a fleet of two).

With `--adapters N` every worker serves N random LoRA adapters (`--max-loras` K in a batch,
rank `--adapter-rank`), tenant t's requests name adapter t mod N, and each run also reports
the workers' adapter loads per completed request (benchmarks/gateway_adapters.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.gateway_adapters import (
    ADAPTER_ROUTERS,
    add_adapter_arguments,
    check_adapter_arguments,
    write_fleet_adapters,
)
from benchmarks.gateway_calibrate import (
    FleetShape,
    GatewayRouteKeys,
    can_simulate,
    print_calibration,
    simulate,
)
from benchmarks.gateway_cases import CASES, Bench, case_of
from benchmarks.gateway_overhead import OverheadRun, print_overhead
from kvserve.bench.gateway_fleet import (
    IDEAL,
    Fleet,
    RouterSpec,
)
from kvserve.bench.gateway_lora import LOAD_COUNT_NOTES
from kvserve.bench.gateway_report import CaseRun, print_pooled, print_tables
from kvserve.bench.gateway_workload import (
    BlockTexts,
    add_workload_arguments,
    bench_model_prompts,
    gateway_requests,
    kv_bytes_per_token,
    spec_from_args,
    tenant_trace,
    working_set_tokens,
)
from kvserve.bench.plots import (
    GATEWAY_CDF_PNG,
    GATEWAY_HIT_PNG,
    PlotsUnavailable,
    gateway_plots,
    require_plots,
)
from kvserve.bench.serve_prompts import PromptSpec
from kvserve.bench.server_launch import (
    KVSERVE,
    VLLM,
    LaunchError,
    LaunchSpec,
    retry_port_clash,
)
from kvserve.gateway.core.prefix import DEFAULT_BLOCK_CHARS
from kvserve.sim.client import ClientConfig

DEFAULT_ROUTERS = ("ideal,kvserve:prefix_hash,kvserve:cache_aware,kvserve:round_robin,"
                   "sglang:cache_aware,sglang:round_robin")


def _warn(err: Console) -> Callable[[str], None]:
    return lambda message: err.print(f"[yellow]{message}[/]", soft_wrap=True)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("gateway", help="routers side by side on a local multi-tenant fleet",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="base", help=f"comma-separated: {', '.join(CASES)}, all")
    p.add_argument("--routers", default=None,
                   help="comma-separated: ideal, kvserve:POLICY, sglang:POLICY, "
                        "envoy+kvserve-epp:POLICY (Envoy in front of `kvserve epp`); default "
                        f"{DEFAULT_ROUTERS} ({ADAPTER_ROUTERS} with --adapters)")
    p.add_argument("--workers", type=int, default=2, help="workers in the fleet")
    p.add_argument("--worker-server", choices=(KVSERVE, VLLM), default=KVSERVE)
    p.add_argument("--model", default="tiny", help="tiny, 100m or a checkpoint dir")
    w = p.add_argument_group("workload")
    add_workload_arguments(w)
    w.add_argument("--skew", type=float, default=1.2, help="Zipf skew of the 'skew' case")
    w.add_argument("--repeats", type=int, default=1,
                   help="runs of every case and router, with seeds --seed, --seed+1, ...; the "
                        "calibration table pools them")
    w.add_argument("--overhead-prompt-tokens", type=int, default=32,
                   help="prompt of the 'overhead' case's 1-token requests")
    f = p.add_argument_group("workers")
    f.add_argument("--working-set", type=float, default=1.5,
                   help="shared prefixes / one worker's KV cache (sizes the cache)")
    f.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every worker, e.g. --worker-arg=--kv-host-tier-bytes"
                        "=134217728 (repeatable)")
    f.add_argument("--max-num-seqs", type=int, default=16)
    f.add_argument("--max-num-batched-tokens", type=int, default=2048)
    f.add_argument("--startup-timeout", type=float, default=300.0)
    c = p.add_argument_group("clients and routers")
    c.add_argument("--overload", type=float, default=3.0, help="rate factor of 'overload'")
    c.add_argument("--ttft-timeout", type=float, default=3.0,
                   help="'overload' clients resend after this many seconds without a token")
    c.add_argument("--max-retries", type=int, default=3)
    c.add_argument("--sdk-retries", action="store_true",
                   help="a 429 spends one of --max-retries too, as the OpenAI SDKs count it "
                        "(their default is 2): a request refused that often is lost")
    c.add_argument("--deadline", type=float, default=120.0, help="seconds before a request "
                   "counts as lost")
    c.add_argument("--gateway-max-in-flight", type=int, default=256,
                   help="kvserve gateway admission limit (its own default)")
    c.add_argument("--gateway-queue-timeout", type=float, default=1.0,
                   help="kvserve gateway admission queue timeout, s (its own default)")
    c.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for each `kvserve gateway` (repeatable)")
    add_adapter_arguments(p)
    p.add_argument("--calibrate", default=None, metavar="PROFILE",
                   help="also simulate each kvserve policy run with this cost profile "
                        "(kvserve: `python -m benchmarks profile --threads 1`) and compare")
    p.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    p.add_argument("--plot", type=Path, default=None, metavar="DIR",
                   help=f"write {GATEWAY_HIT_PNG} and {GATEWAY_CDF_PNG} (per case, by router) "
                        "into DIR")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    err = Console(stderr=True)
    try:
        names = CASES if args.cases.strip() == "all" else [
            n.strip() for n in args.cases.split(",") if n.strip()]
        cases = [case_of(n) for n in names]
        default_routers = DEFAULT_ROUTERS if args.adapters is None else ADAPTER_ROUTERS
        routers = [RouterSpec.parse(r) for r in (args.routers or default_routers).split(",")
                   if r.strip()]
        check_adapter_arguments(args, routers)
        if args.calibrate and args.worker_arg:
            raise ValueError("--calibrate simulates workers as `kvserve serve` runs them by "
                             "default; drop --worker-arg to calibrate")
        if min(args.workers, args.requests, args.repeats) < 1 or args.rate <= 0:
            raise ValueError("--workers, --requests and --repeats must be >= 1 and --rate "
                             "positive")
        require_plots(args.plot)
        spec = spec_from_args(args)
        model_dir, builder = bench_model_prompts(args.model)
        texts = BlockTexts(builder)
    except (ValueError, OSError, PlotsUnavailable) as exc:
        err.print(str(exc), style="red", markup=False, soft_wrap=True)
        return 2
    working_set = working_set_tokens(tenant_trace(spec))
    capacity = int(working_set / args.working_set)
    max_len = args.prefix_tokens[1] + args.suffix_tokens[1] + args.output_tokens + 8
    launch = LaunchSpec(model_dir=model_dir, served_model_name=model_dir.name,
                        kv_cache_bytes=capacity * kv_bytes_per_token(model_dir),
                        max_model_len=max(max_len, 4096) if args.worker_server == VLLM
                        else max_len,
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, num_threads=1,
                        # vLLM reports a request's cached prompt tokens only when asked to.
                        extra_args=tuple(args.worker_arg) + (
                            ("--enable-prompt-tokens-details",)
                            if args.worker_server == VLLM else ()))
    if args.worker_server == VLLM and capacity < launch.max_model_len:
        err.print(f"KV cache {capacity} tokens per worker (working set {working_set} / "
                  f"--working-set {args.working_set:g}): vLLM refuses to start below "
                  f"max_model_len ({launch.max_model_len}); lower --working-set or give more "
                  "--tenants, --requests or --prefix-tokens", style="red", markup=False,
                  soft_wrap=True)
        return 2
    err.print(f"working set {working_set} tokens; KV cache {capacity} tokens per worker "
              f"({args.working_set:g}x); {args.workers} {args.worker_server} workers",
              highlight=False)
    profile = None
    if args.calibrate:
        from kvserve.sim.profiles import load_profile

        try:
            profile = load_profile(args.calibrate)
        except ValueError as exc:
            err.print(f"[red]--calibrate: {exc}[/]", soft_wrap=True)
            return 2
    shape = FleetShape(num_workers=args.workers, kv_tokens_per_worker=capacity, block_size=16,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       max_num_seqs=args.max_num_seqs, max_model_len=launch.max_model_len,
                       max_in_flight=args.gateway_max_in_flight,
                       queue_timeout_s=args.gateway_queue_timeout,
                       route_block_tokens=round(DEFAULT_BLOCK_CHARS / texts.chars_per_token()))
    runs: list[CaseRun] = []
    overheads: list[OverheadRun] = []
    sims: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-gateway-") as tmp:
        try:
            adapters = write_fleet_adapters(args, model_dir, Path(tmp))
        except ValueError as exc:
            err.print(str(exc), style="red", markup=False, soft_wrap=True)
            return 2
        fleet = Fleet(args.worker_server, launch, args.workers, Path(tmp), args.startup_timeout,
                      kv_events=True, adapters=adapters)
        shape = replace(shape, worker_ids=tuple(fleet.urls))
        bench = Bench(args, fleet, spec, texts, model_dir.name, Path(tmp), err)
        try:
            fleet.start()
            for case in cases:
                if case.name == "overhead":
                    prompts = builder.build(PromptSpec(64, args.overhead_prompt_tokens), "ovh")
                    for _, router in itertools.product(range(args.repeats), routers):
                        err.print(f"[bold]overhead[/] · {router.label} …", highlight=False)
                        try:
                            overheads.append(retry_port_clash(
                                partial(bench.overhead, router, prompts), _warn(err)))
                        except LaunchError as exc:
                            err.print(f"[yellow]{router.label}: skipped: {exc}[/]",
                                      soft_wrap=True)
                    continue
                # Routers interleave within a repeat, so drift on the machine hits them alike.
                for seed, router in itertools.product(
                        range(args.seed, args.seed + args.repeats), routers):
                    if case.replicas > 1 and router.kind == IDEAL:
                        continue  # the clients' own split has no replicas
                    err.print(f"[bold]{case.name}[/] · seed {seed} · {router.label} …",
                              highlight=False)
                    try:
                        result = retry_port_clash(
                            partial(bench.run, case, router, seed), _warn(err))
                    except LaunchError as exc:
                        err.print(f"[yellow]{router.label}: skipped: {exc}[/]", soft_wrap=True)
                        continue
                    runs.append(result)
                    err.print(f"  {result.one_line()}", highlight=False)
                    if profile is not None and can_simulate(result):
                        cp = bench.client_policy(case)
                        client = (ClientConfig.retrying(cp.ttft_timeout_s, cp.max_retries)
                                  if cp.ttft_timeout_s is not None else ClientConfig())
                        trace = bench.trace_for(case, seed)
                        keys = GatewayRouteKeys(gateway_requests(trace, texts), model_dir.name,
                                                shape.route_block_tokens)
                        result.sim = sims[len(runs) - 1] = simulate(
                            result, trace, keys, shape, profile, client)
        except LaunchError as exc:
            err.print(f"[red]fleet failed: {exc}[/]", soft_wrap=True)
            return 1
        finally:
            fleet.stop()
    if overheads:
        print_overhead(overheads)
    print_tables(runs, f"{args.workers} {args.worker_server} workers ({args.model}), "
                       f"{args.tenants} tenants x {args.prefix_tokens[0]}-{args.prefix_tokens[1]}"
                       f"-token prefixes, {args.requests} requests at {args.rate:g}/s, KV "
                       f"{capacity} tokens/worker"
                       + (f", {args.adapters} adapters of rank {args.adapter_rank}, "
                          f"{args.max_loras} slots/worker" if args.adapters else ""))
    if args.adapters:
        print(LOAD_COUNT_NOTES[args.worker_server])
    print_pooled(runs)
    print_calibration(runs, sims)
    if args.json:
        args.json.write_text(json.dumps({
            "config": {k: (v if isinstance(v, int | float | str | bool | None) else str(v))
                       for k, v in vars(args).items() if k != "func"},
            "working_set_tokens": working_set, "kv_tokens_per_worker": capacity,
            "adapter_loads_counted": (LOAD_COUNT_NOTES[args.worker_server] if args.adapters
                                      else None),
            "runs": [r.as_dict() for r in runs],
            "overhead": [r.as_dict() for r in overheads]}, indent=1))
    if args.plot is not None and runs:
        try:
            paths = gateway_plots(runs, args.plot, f"python -m benchmarks gateway: {args.workers} "
                                  f"{args.worker_server} workers, {args.requests} requests")
        except PlotsUnavailable as exc:
            err.print(str(exc), style="red", markup=False, soft_wrap=True)
            return 2
        err.print(f"wrote {', '.join(str(p) for p in paths)}", soft_wrap=True, highlight=False)
    return 0
