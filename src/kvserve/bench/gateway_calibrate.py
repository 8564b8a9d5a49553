"""`kvserve bench gateway --calibrate PROFILE`: the simulator beside the measured fleet.

For each measured run of a kvserve gateway policy the simulator can drive (one replica, no
worker kill), the very same trace is replayed through `kvserve.sim` with the same fleet: number of
workers, KV blocks per worker, block size, scheduler limits, the gateway's policy and admission
limits, and the clients' timeout and retries. Step times come from PROFILE (`kvserve`: the one
`kvserve bench profile --threads 1` measured here, matching the workers' one thread each). The
table puts simulated TTFT p50/p99, throughput and hit rate next to the measured ones, as
simulated / measured.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from kvserve.bench.gateway_report import CaseRun
from kvserve.sim import CostProfile
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


def can_simulate(run: CaseRun) -> bool:
    policy = run.router.removeprefix(KVSERVE_PREFIX)
    return (run.router.startswith(KVSERVE_PREFIX) and policy in SIMULATED_POLICIES
            and run.replicas == 1 and not run.actions)


def simulate(run: CaseRun, trace: Sequence[TraceRequest], shape: FleetShape,
             profile: CostProfile, client: ClientConfig) -> dict[str, Any]:
    """The simulator's figures for `run`'s fleet and workload, in the report's units."""
    worker = WorkerConfig(num_blocks=shape.kv_tokens_per_worker // shape.block_size,
                          block_size=shape.block_size,
                          max_num_batched_tokens=shape.max_num_batched_tokens,
                          max_num_seqs=shape.max_num_seqs, max_model_len=shape.max_model_len)
    config = SimConfig(num_workers=shape.num_workers, worker=worker, profile=profile,
                       policy=run.router.removeprefix(KVSERVE_PREFIX), client=client,
                       backpressure=Backpressure(max_in_flight=shape.max_in_flight,
                                                 queue_timeout_s=shape.queue_timeout_s),
                       route_block_tokens=shape.route_block_tokens)
    result = FleetSimulator(config, Workload("bench-gateway", tuple(trace))).run()

    def ms(v: float | None) -> float:
        return float("nan") if v is None else v * 1e3

    return {"ttft_ms": {"p50": ms(result.ttft_p50), "p99": ms(result.ttft_p99)},
            "request_throughput": result.requests_per_s, "hit_rate": result.hit_rate,
            "completed": result.num_ok, "profile": profile.name}


def _ratio(sim: float, measured: float) -> str:
    if math.isnan(sim) or math.isnan(measured) or measured == 0:
        return "-"
    return f"{sim / measured:.2f}"


def print_calibration(runs: Sequence[CaseRun], sims: dict[int, dict[str, Any]]) -> None:
    """One row per simulated run: measured, simulated, simulated / measured."""
    if not sims:
        return
    table = Table(title="simulator vs measured (ratio = simulated / measured)",
                  title_justify="left")
    for col in ("case", "router", "TTFT p50 ms", "sim", "ratio", "TTFT p99 ms", "sim", "ratio",
                "req/s", "sim", "ratio", "hit rate", "sim"):
        table.add_column(col, justify="left" if col in ("case", "router") else "right")
    for idx, sim in sims.items():
        run = runs[idx]
        m50, m99 = run.ttft_ms["p50"], run.ttft_ms["p99"]
        s50, s99 = sim["ttft_ms"]["p50"], sim["ttft_ms"]["p99"]
        table.add_row(run.case, run.router, f"{m50:.0f}", f"{s50:.0f}", _ratio(s50, m50),
                      f"{m99:.0f}", f"{s99:.0f}", _ratio(s99, m99),
                      f"{run.request_throughput:.2f}", f"{sim['request_throughput']:.2f}",
                      _ratio(sim["request_throughput"], run.request_throughput),
                      f"{run.hit_rate:.3f}", f"{sim['hit_rate']:.3f}")
    Console(width=200).print(table)
