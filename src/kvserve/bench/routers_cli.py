"""`kvserve bench gateway`: routers side by side on your own workers, multi-tenant traffic.

Give your workers (`--worker URL`, repeatable: kvserve, vLLM or SGLang servers, anything
OpenAI-compatible), or let the command start a local fleet (`--workers N` kvserve or vLLM
servers). For each router, in turn, the same open-loop multi-tenant workload is sent
(gateway_load.py): through kvserve's gateway (`kvserve:POLICY`), SGLang's router
(`sglang:POLICY`, docs/peers.md), Envoy in front of `kvserve epp` (`envoy+kvserve-epp:POLICY`),
or `ideal`, the clients' own split that pins each tenant to one worker (the hit-rate ceiling).
The table gives the fleet hit rate (from the workers' vLLM-named prefix-cache counters, which
kvserve and vLLM export), TTFT, throughput, lost requests and each worker's share.

Every router starts cold: each run's prompts begin with a tag of their own, so no run reuses a
prefix another one cached, on workers this command cannot restart; a local fleet is also
restarted (kvserve) or has its prefix cache reset (vLLM) between routers. Prompts are sized in
`--model`'s tokens (its tokenizer, the demo model's by default; give your model's checkpoint
directory to size them in its tokens). The development suite behind this command (failover,
overload, router replicas, calibration against the simulator) is `python -m benchmarks gateway`
in the repository (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import tempfile
from dataclasses import replace
from pathlib import Path

import httpx
from rich.console import Console

from kvserve.bench.gateway_counters import CounterPoller
from kvserve.bench.gateway_fleet import (
    IDEAL,
    KVSERVE_GATEWAY,
    Fleet,
    RouterSpec,
    make_router,
)
from kvserve.bench.gateway_load import (
    ClientPolicy,
    RequestResult,
    Target,
    run_open_loop,
)
from kvserve.bench.gateway_report import CaseRun, print_tables, summarize
from kvserve.bench.gateway_workload import (
    BlockTexts,
    GatewayRequest,
    add_workload_arguments,
    bench_model_prompts,
    gateway_requests,
    ideal_assignment,
    kv_bytes_per_token,
    spec_from_args,
    tenant_trace,
    working_set_tokens,
)
from kvserve.bench.server_launch import KVSERVE, VLLM, CpuReading, LaunchError, LaunchSpec

DEFAULT_ROUTERS = "ideal,kvserve:cache_aware,kvserve:round_robin,sglang:cache_aware"
CASE = "base"  # the suite's name for one replica, even tenant mix, patient clients


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("gateway", help="routers side by side on your workers or a local fleet",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="append", default=[], metavar="URL",
                   help="one of your workers (repeatable); without any, a local fleet starts")
    p.add_argument("--routers", default=DEFAULT_ROUTERS,
                   help="comma-separated: ideal, kvserve:POLICY, sglang:POLICY, "
                        "envoy+kvserve-epp:POLICY")
    p.add_argument("--served-model-name", default=None,
                   help="the model the requests name (default: the first worker's /v1/models)")
    p.add_argument("--model", default="tiny",
                   help="tiny, 100m or a checkpoint dir: its tokenizer sizes the prompts, and "
                        "the local fleet serves it")
    p.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for each kvserve router, e.g. "
                        "--gateway-arg=--worker-kv-events=URL=tcp://HOST:PORT (repeatable)")
    f = p.add_argument_group("local fleet (without --worker)")
    f.add_argument("--workers", type=int, default=2, help="workers to start")
    f.add_argument("--worker-server", choices=(KVSERVE, VLLM), default=KVSERVE)
    f.add_argument("--working-set", type=float, default=1.5,
                   help="shared prefixes / one worker's KV cache (sizes each worker's cache)")
    f.add_argument("--startup-timeout", type=float, default=300.0)
    w = p.add_argument_group("workload")
    add_workload_arguments(w)
    p.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    p.set_defaults(func=run)


def served_model(url: str) -> str:
    """The first model a worker lists; ValueError saying what to pass when it lists none."""
    try:
        models = httpx.get(f"{url}/v1/models", timeout=10.0).raise_for_status().json()["data"]
        return str(models[0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"{url}/v1/models names no model ({exc}): is the worker up? Or pass "
                         "--served-model-name") from exc


def run(args: argparse.Namespace) -> int:
    err = Console(stderr=True)
    try:
        routers = [RouterSpec.parse(r) for r in args.routers.split(",") if r.strip()]
        if not routers or min(args.workers, args.requests, args.tenants) < 1 or args.rate <= 0:
            raise ValueError("--routers needs one router; --workers, --requests and --tenants "
                             "must be >= 1 and --rate positive")
        spec = spec_from_args(args)
        model_dir, builder = bench_model_prompts(args.model)
        texts = BlockTexts(builder)
        trace = tenant_trace(spec)
        requests = gateway_requests(trace, texts)
        model = args.served_model_name or (served_model(args.worker[0]) if args.worker
                                           else model_dir.name)
    except (ValueError, OSError) as exc:
        err.print(str(exc), style="red", markup=False, soft_wrap=True)
        return 2
    runs: list[CaseRun] = []
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-gateway-") as tmp:
        fleet = None
        if not args.worker:
            capacity = int(working_set_tokens(trace) / args.working_set)
            max_len = args.prefix_tokens[1] + args.suffix_tokens[1] + args.output_tokens + 8
            launch = LaunchSpec(model_dir=model_dir, served_model_name=model,
                                kv_cache_bytes=capacity * kv_bytes_per_token(model_dir),
                                max_model_len=max(max_len, 4096) if args.worker_server == VLLM
                                else max_len, max_num_seqs=16, max_num_batched_tokens=2048,
                                num_threads=1,
                                # vLLM reports a request's cached prompt tokens only when asked.
                                extra_args=("--enable-prompt-tokens-details",)
                                if args.worker_server == VLLM else ())
            precise = any(r.kind == KVSERVE_GATEWAY and r.policy == "precise" for r in routers)
            fleet = Fleet(args.worker_server, launch, args.workers, Path(tmp),
                          args.startup_timeout, kv_events=precise)
            err.print(f"local fleet: {args.workers} {args.worker_server} workers, KV cache "
                      f"{capacity} tokens each (the shared prefixes are {args.working_set:g}x "
                      "that)", highlight=False)
        try:
            if fleet is not None:
                fleet.start()
            urls = fleet.urls if fleet is not None else list(args.worker)
            for i, router in enumerate(routers):
                err.print(f"[bold]{router.label}[/] …", highlight=False)
                if fleet is not None and i > 0:
                    fleet.fresh()
                gateway_args = [*args.gateway_arg]
                if fleet is not None and router.kind == KVSERVE_GATEWAY and \
                        router.policy == "precise":
                    gateway_args = [*fleet.precise_args(), *gateway_args]
                try:
                    result = run_router(router, urls, _tagged(requests), model, Path(tmp),
                                        gateway_args, fleet)
                except LaunchError as exc:
                    err.print(f"[yellow]{router.label}: skipped: {exc}[/]", soft_wrap=True)
                    continue
                runs.append(result)
                err.print(f"  {result.one_line()}", highlight=False)
        except LaunchError as exc:
            err.print(f"[red]fleet failed: {exc}[/]", soft_wrap=True)
            return 1
        finally:
            if fleet is not None:
                fleet.stop()
    where = (f"{len(args.worker)} workers of yours" if args.worker
             else f"{args.workers} local {args.worker_server} workers ({args.model})")
    print_tables(runs, f"{where}, {args.tenants} tenants x {args.prefix_tokens[0]}-"
                       f"{args.prefix_tokens[1]}-token prefixes, {args.requests} requests at "
                       f"{args.rate:g}/s")
    if args.json:
        args.json.write_text(json.dumps({
            "config": {k: (v if isinstance(v, int | float | str | bool | None) else str(v))
                       for k, v in vars(args).items() if k != "func"},
            "runs": [r.as_dict() for r in runs]}, indent=1))
    return 0


def _tagged(requests: list[GatewayRequest]) -> list[GatewayRequest]:
    """The requests with a fresh tag in front of every prompt: a cold start for this run on
    any worker (the tag changes the first KV block, so no cached prefix matches)."""
    tag = f"[{secrets.token_hex(4)}] "
    return [replace(r, prompt=tag + r.prompt) for r in requests]


def run_router(router: RouterSpec, urls: list[str], requests: list[GatewayRequest], model: str,
               log_dir: Path, gateway_args: list[str], fleet: Fleet | None) -> CaseRun:
    """One router in front of `urls` (none for `ideal`), the open-loop load, its figures."""
    proc = None if router.kind == IDEAL else make_router(router, urls, log_dir, gateway_args)
    workers = fleet.workers if fleet is not None else []
    try:
        if proc is not None:
            proc.start()
        target = _target(proc.url if proc is not None else None, urls, requests)
        poller = CounterPoller(urls)
        before = CpuReading.of([proc] if proc else [], workers)
        results, duration, log = asyncio.run(_with_poller(poller, requests, model, target))
        cpu = CpuReading.of([proc] if proc else [], workers).per_request_ms(before,
                                                                             len(requests))
    finally:
        if proc is not None:
            proc.stop()
    result = summarize(CASE, router.label, 1, requests, results, duration, poller, log,
                       block_tokens=fleet.block_size if fleet is not None else 16,
                       text_keyed=router.keys_text)
    result.cpu_ms_per_request = cpu
    return result


def _target(router_url: str | None, urls: list[str], requests: list[GatewayRequest]) -> Target:
    """Every attempt to the router, or without one (`ideal`) to the tenant's own worker, the
    next one on a resend."""
    if router_url is not None:
        return lambda req, attempt: router_url
    home = ideal_assignment(requests, len(urls))
    return lambda req, attempt: urls[(home[req.tenant] + attempt) % len(urls)]


async def _with_poller(poller: CounterPoller, requests: list[GatewayRequest], model: str,
                       target: Target) -> tuple[list[RequestResult], float, list[str]]:
    stop = asyncio.Event()
    task = asyncio.create_task(poller.run(stop))
    try:
        return await run_open_loop(requests, model, target, ClientPolicy())
    finally:
        await asyncio.sleep(1.5)  # let the workers' counters catch up with the last request
        stop.set()
        await task
