"""`python -m benchmarks gateway --calibrate PROFILE`: the simulator beside the measured fleet.

For each measured run of a kvserve gateway policy the simulator can drive (one replica, no
worker kill), the very same trace is replayed through `kvserve.sim` with the same fleet: number of
workers, KV blocks per worker, block size, scheduler limits, the gateway's policy and admission
limits, and the clients' timeout and retries. The simulated policy routes on the gateway's own
keys: each request's text prompt keyed by `route_request_for` with the salt the gateway injects
for its tenant, so rendezvous hashing places every tenant where the real gateway did. Step times
come from PROFILE (`python -m benchmarks profile --threads 1 --colocated N --server --out P`,
matching the workers' one thread each; measure it right before the fleet, since absolute times
on a shared machine drift by more than the 15% the comparison is judged by). The table puts
simulated TTFT p50/p99, throughput and hit rate next to the measured ones, as simulated /
measured.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from kvserve.bench.gateway_fleet import BENCH_SALT_SECRET
from kvserve.bench.gateway_report import CaseRun
from kvserve.bench.gateway_workload import GatewayRequest
from kvserve.engine.lora import AdapterRef
from kvserve.gateway.core.pipeline import RouteRequest
from kvserve.gateway.core.route_key import route_request_for
from kvserve.gateway.core.tenancy import Tenancy
from kvserve.percentiles import percentile
from kvserve.sim import CostProfile, RouteKeys
from kvserve.sim.client import ClientConfig
from kvserve.sim.fleet import SIMULATED_POLICIES, FleetSimulator, SimConfig
from kvserve.sim.gateway import Backpressure
from kvserve.sim.worker import WorkerConfig
from kvserve.sim.workload import Workload
from kvserve.workload import TraceRequest

KVSERVE_PREFIX = "kvserve:"


@dataclass(frozen=True, slots=True)
class FleetShape:
    """What the simulated fleet copies from the measured one."""

    num_workers: int
    kv_tokens_per_worker: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    max_in_flight: int
    queue_timeout_s: float
    route_block_tokens: int
    worker_ids: tuple[str, ...] = ()  # the measured gateway's ids for its workers: their URLs


class GatewayRouteKeys(RouteKeys):
    """The kvserve gateway's keys for the bench's text prompts, by request id (see the module
    docstring); `tenancy` must be the measured gateways' (the default: the bench fleet's)."""

    def __init__(self, requests: Sequence[GatewayRequest], model: str, block_tokens: int,
                 tenancy: Tenancy | None = None) -> None:
        super().__init__(block_tokens)
        tenancy = tenancy or Tenancy(BENCH_SALT_SECRET, trust_header=True)
        self._keys = {
            r.request_id: route_request_for(
                "/v1/completions", {"model": model, "prompt": r.prompt},
                tenancy.resolve({tenancy.header: r.tenant}).salt)
            for r in requests}

    def route_request(self, request: TraceRequest, token_ids: Sequence[int],
                      adapter: AdapterRef | None = None) -> RouteRequest:
        if adapter is not None:
            raise ValueError("the gateway bench sends no LoRA requests; its keys have no adapter")
        return self._keys[request.request_id]


def can_simulate(run: CaseRun) -> bool:
    policy = run.router.removeprefix(KVSERVE_PREFIX)
    return (run.router.startswith(KVSERVE_PREFIX) and policy in SIMULATED_POLICIES
            and run.replicas == 1 and not run.actions)


def simulate(run: CaseRun, trace: Sequence[TraceRequest], keys: RouteKeys, shape: FleetShape,
             profile: CostProfile, client: ClientConfig) -> dict[str, Any]:
    """The simulator's figures for `run`'s fleet and workload (routed on `keys`), in the
    report's units."""
    worker = WorkerConfig(num_blocks=shape.kv_tokens_per_worker // shape.block_size,
                          block_size=shape.block_size,
                          max_num_batched_tokens=shape.max_num_batched_tokens,
                          max_num_seqs=shape.max_num_seqs, max_model_len=shape.max_model_len)
    config = SimConfig(num_workers=shape.num_workers, worker=worker, profile=profile,
                       policy=run.router.removeprefix(KVSERVE_PREFIX), client=client,
                       backpressure=Backpressure(max_in_flight=shape.max_in_flight,
                                                 queue_timeout_s=shape.queue_timeout_s),
                       route_block_tokens=shape.route_block_tokens,
                       worker_ids=shape.worker_ids or None)
    result = FleetSimulator(config, Workload("bench-gateway", tuple(trace)),
                            route_keys=keys).run()

    def ms(v: float | None) -> float:
        return float("nan") if v is None else v * 1e3

    queried = sum(w.queried_tokens for w in result.workers)
    return {"ttft_ms": {"p50": ms(result.ttft_p50), "p99": ms(result.ttft_p99)},
            "request_throughput": result.requests_per_s, "hit_rate": result.hit_rate,
            "completed": result.num_ok, "profile": profile.name,
            "ttfts_ms": sorted(t * 1e3 for t in result.ttfts),
            # Measured shares are of the workers' prefix-cache queries: the same counter here.
            "worker_shares": [w.queried_tokens / queried if queried else float("nan")
                              for w in result.workers]}


def _ratio(sim: float, measured: float) -> str:
    if math.isnan(sim) or math.isnan(measured) or measured == 0:
        return "-"
    return f"{sim / measured:.2f}"


@dataclass(frozen=True, slots=True)
class CalibrationRow:
    """Measured and simulated figures of one run, or of several runs pooled (their requests'
    TTFTs pooled before the percentiles are taken; throughput and hit rate averaged)."""

    case: str
    seeds: str
    router: str
    measured_ttfts: list[float]
    sim_ttfts: list[float]
    measured_rps: float
    sim_rps: float
    measured_hit: float
    sim_hit: float


def _pct(values: list[float], p: float) -> float:
    v = percentile(values, p)
    return float("nan") if v is None else v


def calibration_rows(runs: Sequence[CaseRun],
                     sims: dict[int, dict[str, Any]]) -> list[CalibrationRow]:
    """One row per simulated run, then, for every (case, router) run more than once, one pooled
    row: a p99 over a few hundred requests moves far less between repeats than one over 160."""
    rows, groups = [], defaultdict(list)
    for idx, sim in sims.items():
        run = runs[idx]
        rows.append(CalibrationRow(run.case, str(run.seed), run.router, run.ttfts_ms,
                                   sim["ttfts_ms"], run.request_throughput,
                                   sim["request_throughput"], run.hit_rate, sim["hit_rate"]))
        groups[(run.case, run.router)].append(rows[-1])
    for (case, router), group in groups.items():
        if len(group) < 2:
            continue
        rows.append(CalibrationRow(
            case, "pooled " + "+".join(r.seeds for r in group), router,
            sorted(t for r in group for t in r.measured_ttfts),
            sorted(t for r in group for t in r.sim_ttfts),
            statistics.fmean(r.measured_rps for r in group),
            statistics.fmean(r.sim_rps for r in group),
            statistics.fmean(r.measured_hit for r in group),
            statistics.fmean(r.sim_hit for r in group)))
    return rows


def print_calibration(runs: Sequence[CaseRun], sims: dict[int, dict[str, Any]]) -> None:
    """Measured, simulated, simulated / measured: per run, then pooled over seeds."""
    if not sims:
        return
    table = Table(title="simulator vs measured (ratio = simulated / measured)",
                  title_justify="left")
    for col in ("case", "seed", "router", "TTFT p50 ms", "sim", "ratio", "TTFT p99 ms", "sim",
                "ratio", "req/s", "sim", "ratio", "hit rate", "sim"):
        table.add_column(col, justify="left" if col in ("case", "seed", "router") else "right")
    for row in calibration_rows(runs, sims):
        m50, m99 = _pct(row.measured_ttfts, 50), _pct(row.measured_ttfts, 99)
        s50, s99 = _pct(row.sim_ttfts, 50), _pct(row.sim_ttfts, 99)
        table.add_row(row.case, row.seeds, row.router, f"{m50:.0f}", f"{s50:.0f}",
                      _ratio(s50, m50), f"{m99:.0f}", f"{s99:.0f}", _ratio(s99, m99),
                      f"{row.measured_rps:.2f}", f"{row.sim_rps:.2f}",
                      _ratio(row.sim_rps, row.measured_rps), f"{row.measured_hit:.3f}",
                      f"{row.sim_hit:.3f}")
    Console(width=200).print(table)
