"""The cases of `python -m benchmarks gateway` and one run of a case behind a router.

A case shapes the workload (`trace_for`: skew, overload rate) and the clients (`client_policy`:
TTFT timeout and resends in overload) and may act on the fleet (failover kills and restarts
worker 1). `Bench.run` makes the fleet cold, starts the router's replicas, sends the open-loop
load through them (or straight to the workers for `ideal`), and summarizes what the clients
and the workers' counters saw.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.gateway_overhead import OverheadRun, measure_overhead
from kvserve.bench.gateway_counters import CounterPoller
from kvserve.bench.gateway_envoy import ENVOY_EPP
from kvserve.bench.gateway_fleet import (
    IDEAL,
    KVSERVE_GATEWAY,
    Fleet,
    RouterSpec,
    gateway_stats,
    make_router,
)
from kvserve.bench.gateway_load import (
    ClientPolicy,
    Target,
    TimedAction,
    run_open_loop,
)
from kvserve.bench.gateway_report import CaseRun, summarize
from kvserve.bench.gateway_workload import (
    BlockTexts,
    GatewayRequest,
    gateway_requests,
    ideal_assignment,
    tenant_trace,
)
from kvserve.bench.server_launch import CpuReading
from kvserve.workload import MultiTenantSpec, TraceRequest

CASES = ("base", "replicas2", "replicas4", "skew", "overload", "failover", "overhead")


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    replicas: int = 1
    skewed: bool = False
    overload: bool = False
    failover: bool = False


def case_of(name: str) -> Case:
    if name not in CASES:
        raise ValueError(f"--cases {name!r}: choose from {', '.join(CASES)}")
    if name.startswith("replicas"):
        return Case(name, replicas=int(name.removeprefix("replicas")))
    return Case(name, skewed=name == "skew", overload=name == "overload",
                failover=name == "failover")


class Bench:
    """Everything one invocation shares: the fleet, the workload, the output console."""

    def __init__(self, args: argparse.Namespace, fleet: Fleet, spec: MultiTenantSpec,
                 texts: BlockTexts, model: str, log_dir: Path, err: Console) -> None:
        self.args, self.fleet, self.spec, self.texts = args, fleet, spec, texts
        self.model, self.log_dir, self.err = model, log_dir, err
        self.gateway_args = [f"--max-in-flight={args.gateway_max_in_flight}",
                             f"--queue-timeout={args.gateway_queue_timeout}", *args.gateway_arg]

    def router_args(self, router: RouterSpec) -> list[str]:
        """The shared gateway flags, and for `precise` how to follow the fleet's KV events."""
        if router.kind == KVSERVE_GATEWAY and router.policy == "precise":
            return [*self.fleet.precise_args(), *self.gateway_args]
        return self.gateway_args

    def trace_for(self, case: Case, seed: int) -> list[TraceRequest]:
        spec = replace(self.spec, seed=seed)
        if case.skewed:
            spec = replace(spec, skew=self.args.skew)
        if case.overload:
            spec = replace(spec, rate_per_s=spec.rate_per_s * self.args.overload)
        return tenant_trace(spec)

    def client_policy(self, case: Case) -> ClientPolicy:
        return ClientPolicy(ttft_timeout_s=self.args.ttft_timeout if case.overload else None,
                            max_retries=self.args.max_retries, deadline_s=self.args.deadline,
                            rejections_spend_retries=self.args.sdk_retries)

    def overhead(self, router: RouterSpec, prompts: list[str]) -> OverheadRun:
        """The overhead case for one router (`ideal`: straight to the workers)."""
        proc = None if router.kind == IDEAL else make_router(
            router, self.fleet.urls, self.log_dir, self.router_args(router))
        self.fleet.fresh()
        try:
            if proc is not None:
                proc.start()
            entries = self.fleet.urls if proc is None else [proc.url]
            return measure_overhead(router.label, entries, prompts, self.model)
        finally:
            if proc is not None:
                proc.stop()

    def requests_for(self, case: Case, seed: int) -> list[GatewayRequest]:
        """The case's requests, each naming its tenant's adapter when the fleet serves some."""
        adapters = self.fleet.adapters
        return gateway_requests(self.trace_for(case, seed), self.texts,
                                adapters.adapter_for if adapters is not None else None)

    def run(self, case: Case, router: RouterSpec, seed: int) -> CaseRun:
        requests = self.requests_for(case, seed)
        urls = self.fleet.urls
        replicas = [] if router.kind == IDEAL else [
            make_router(router, urls, self.log_dir, self.router_args(router))
            for _ in range(case.replicas)]
        self.fleet.fresh()
        try:
            for r in replicas:
                r.launch()
            for r in replicas:
                r.wait_healthy()
            target = self._target(router, requests, [r.url for r in replicas])
            policy = self.client_policy(case)
            actions = self._actions(case, requests)
            poller = CounterPoller(urls, load_readers=self.fleet.load_readers())
            before = CpuReading.of(replicas, self.fleet.workers)
            results, duration, log = asyncio.run(
                _with_poller(poller, run_open_loop(requests, self.model, target, policy,
                                                   actions)))
            cpu = CpuReading.of(replicas, self.fleet.workers).per_request_ms(
                before, len(requests))
            stats = (gateway_stats([getattr(r, "metrics_url", r.url) for r in replicas])
                     if router.kind in (KVSERVE_GATEWAY, ENVOY_EPP) else {})
        finally:
            for r in replicas:
                r.stop()
        run = summarize(case.name, router.label, case.replicas, requests, results, duration,
                        poller, log, seed, self.fleet.block_size,
                        text_keyed=router.keys_text)
        run.router_stats = stats
        run.cpu_ms_per_request = cpu
        return run

    def _target(self, router: RouterSpec, requests: list[GatewayRequest],
                entries: list[str]) -> Target:
        urls = self.fleet.urls
        if router.kind == IDEAL:
            adapters = self.fleet.adapters
            home = ideal_assignment(requests, len(urls),
                                    adapters.adapter_for if adapters is not None else None)
            return lambda req, attempt: urls[(home[req.tenant] + attempt) % len(urls)]
        rotation = itertools.cycle(entries)  # the plain round-robin balancer
        return lambda req, attempt: next(rotation)

    def _actions(self, case: Case, requests: list[GatewayRequest]) -> list[TimedAction]:
        if not case.failover or len(self.fleet.workers) < 2:
            return []
        span = requests[-1].arrival_s
        return [TimedAction(span / 3, "kill worker 1", lambda: self.fleet.kill(1)),
                TimedAction(2 * span / 3, "restart worker 1", lambda: self.fleet.restart(1))]


async def _with_poller(poller: CounterPoller, load: Any) -> Any:
    """Run `load` (a coroutine) once the poller has its baseline, polling until it is done."""
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(poller.run(stop, ready))
    try:
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        return await load
    finally:
        await asyncio.sleep(1.5)  # let the workers' counters catch up with the last request
        stop.set()
        await task
