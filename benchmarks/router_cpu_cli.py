"""`python -m benchmarks router-cpu`: what each router costs in CPU, behind workers that do nothing.

In `kvserve bench gateway` the router shares the machine's cores with real workers, so its CPU
comes out of theirs, but its figure there moves with the workers' noise. Here the workers are
stubs (`benchmarks.stub_worker`: streamed answers of `--tokens` chunks, `--token-interval` apart,
with no model behind them), so what a router spends per request is its own:

- idle: CPU per second with no traffic (health checks, metric scrapes, KV-event polls);
- load: `--requests` streamed completions, `--concurrency` at a time, over `--tenants` long
  shared prefixes (`--prompt-chars` characters each, plus a unique tail): CPU per request (the
  idle rate over the load's duration included) and requests per second.

Routers run one after the other on the same stub workers, interleaved within each repeat, so
every router is measured beside its peers in the same invocation; "vs first" is each router's CPU
per request over the first router's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from benchmarks.stub_worker import StubWorker
from kvserve.bench.gateway_fleet import RouterSpec, make_router
from kvserve.bench.server_launch import LaunchError, ManagedProcess, retry_port_clash

DEFAULT_ROUTERS = "kvserve:cache_aware,kvserve:precise,sglang:cache_aware"


@dataclass(slots=True)
class RouterCpuRun:
    router: str
    repeat: int
    requests: int
    failed: int
    duration_s: float
    cpu_ms_per_request: float
    idle_cpu_ms_per_s: float
    requests_per_s: float


@dataclass(slots=True)
class RouterCpuReport:
    config: dict[str, Any]
    runs: list[RouterCpuRun] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"config": self.config, "runs": [asdict(r) for r in self.runs]}


def _prompts(tenants: int, chars: int, count: int) -> list[tuple[str, str]]:
    """(tenant, prompt) pairs: each tenant's shared prefix, then a tail unique to the request."""
    heads = [(f"Tenant {t} instructions. " * (chars // 24 + 1))[:chars] for t in range(tenants)]
    return [(f"tenant-{i % tenants}", f"{heads[i % tenants]} Question {i}: go on.")
            for i in range(count)]


async def _load(url: str, prompts: list[tuple[str, str]], concurrency: int, tokens: int) -> int:
    """Stream every prompt through `url`; the number that failed."""
    failed = 0
    queue = iter(prompts)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal failed
        for tenant, prompt in queue:
            body = {"model": "stub", "prompt": prompt, "max_tokens": tokens, "stream": True}
            try:
                async with client.stream("POST", f"{url}/v1/completions", json=body,
                                         headers={"X-Tenant-Id": tenant}) as response:
                    data = b"".join([chunk async for chunk in response.aiter_raw()])
                    if response.status_code != 200 or not data.endswith(b"data: [DONE]\n\n"):
                        failed += 1
            except httpx.HTTPError:
                failed += 1

    async with httpx.AsyncClient(timeout=30.0, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return failed


def _cpu(process: ManagedProcess) -> float:
    seconds = process.cpu_seconds()
    if seconds is None:
        raise LaunchError(f"{process.name} is not running, or this platform has no /proc")
    return seconds


def measure(spec: RouterSpec, workers: list[str], args: argparse.Namespace, log_dir: Path,
            repeat: int) -> RouterCpuRun:
    router = make_router(spec, workers, log_dir)
    with router:
        asyncio.run(_load(router.url, _prompts(args.tenants, args.prompt_chars, 64), 8,
                           args.tokens))  # warm: connections, first-request costs
        start = _cpu(router)
        time.sleep(args.idle_seconds)
        idle_per_s = (_cpu(router) - start) / args.idle_seconds
        prompts = _prompts(args.tenants, args.prompt_chars, args.requests)
        start, began = _cpu(router), time.perf_counter()
        failed = asyncio.run(_load(router.url, prompts, args.concurrency, args.tokens))
        used, duration = _cpu(router) - start, time.perf_counter() - began
    return RouterCpuRun(spec.label, repeat, args.requests, failed, duration,
                        1e3 * used / args.requests, 1e3 * idle_per_s, args.requests / duration)


def render(report: RouterCpuReport, console: Console) -> None:
    table = Table(title="router CPU behind stub workers (mean over repeats, min-max)")
    table.add_column("router", no_wrap=True)
    for column in ("CPU ms / request", "vs first", "idle CPU ms / s", "requests / s", "failed"):
        table.add_column(column, justify="right")
    by_router: dict[str, list[RouterCpuRun]] = {}
    for run in report.runs:
        by_router.setdefault(run.router, []).append(run)
    first = None
    for router, runs in by_router.items():
        cpu = [r.cpu_ms_per_request for r in runs]
        mean = statistics.fmean(cpu)
        first = first or mean
        table.add_row(router, f"{mean:.2f} ({min(cpu):.2f}-{max(cpu):.2f})",
                      f"{mean / first:.2f}",
                      f"{statistics.fmean(r.idle_cpu_ms_per_s for r in runs):.1f}",
                      f"{statistics.fmean(r.requests_per_s for r in runs):.0f}",
                      str(sum(r.failed for r in runs)))
    console.print(table)


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    try:
        specs = [RouterSpec.parse(text) for text in args.routers.split(",") if text]
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    if any(s.kind == "ideal" for s in specs):
        console.print("[red]router-cpu measures routers: drop 'ideal' (it has no process)[/red]")
        return 2
    for name in ("requests", "concurrency", "workers", "tenants", "tokens", "prompt_chars"):
        if getattr(args, name) < 1:
            console.print(f"[red]--{name.replace('_', '-')} must be >= 1[/red]")
            return 2
    if not 0 <= args.token_interval <= 10 or not 0 < args.idle_seconds <= 600:
        console.print("[red]--token-interval must be within 0-10 s and --idle-seconds within "
                      "0-600 s[/red]")
        return 2
    report = RouterCpuReport(config={k: v for k, v in vars(args).items() if k != "func"})
    log_dir = Path(tempfile.mkdtemp(prefix="kvserve-router-cpu-"))
    workers = [StubWorker(i, args.tokens, args.token_interval, log_dir)
               for i in range(args.workers)]
    try:
        for worker in workers:
            worker.start()
        for repeat in range(args.repeats):
            for spec in specs:
                try:
                    result = retry_port_clash(
                        partial(measure, spec, [w.url for w in workers], args, log_dir, repeat),
                        lambda message: console.print(f"[yellow]{message}[/yellow]"))
                except LaunchError as exc:
                    console.print(f"[yellow]{spec.label}: skipped ({exc})[/yellow]")
                    continue
                report.runs.append(result)
                console.print(f"{spec.label} · repeat {repeat}: "
                              f"{result.cpu_ms_per_request:.2f} ms CPU a request, idle "
                              f"{result.idle_cpu_ms_per_s:.1f} ms/s, "
                              f"{result.requests_per_s:.0f} req/s, {result.failed} failed")
    finally:
        for worker in workers:
            worker.stop()
    render(report, Console())
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_dict(), indent=2))
    return 0 if report.runs else 1


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("router-cpu", help="each router's CPU per request, behind stub workers",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--routers", default=DEFAULT_ROUTERS,
                   help="comma-separated kvserve:POLICY[@...] and sglang:POLICY")
    p.add_argument("--workers", type=int, default=2, help="stub workers")
    p.add_argument("--requests", type=int, default=2000, help="streamed requests a run")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--tenants", type=int, default=10)
    p.add_argument("--prompt-chars", type=int, default=12000,
                   help="characters of each tenant's shared prefix")
    p.add_argument("--tokens", type=int, default=16, help="streamed chunks a completion")
    p.add_argument("--token-interval", type=float, default=0.005,
                   help="seconds between two chunks (a decode step; 0: as fast as possible)")
    p.add_argument("--idle-seconds", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write the runs here")
    p.set_defaults(func=run)
