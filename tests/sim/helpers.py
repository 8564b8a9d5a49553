"""Small fleets and workloads for the simulator's tests (no shared data needed)."""

from __future__ import annotations

import dataclasses
import random

from kvserve.sim import CostProfile, FleetSimulator, SimConfig, SimResult, WorkerConfig, Workload
from kvserve.sim.profiles import BUILTIN
from kvserve.workload import TraceRequest

ZERO = BUILTIN["zero"]
H100 = BUILTIN["h100"]


def synthetic_trace(num_requests: int = 400, seed: int = 7, num_docs: int = 12,
                    output_length: int = 1, rate_per_s: float = 50.0) -> Workload:
    """Requests that share 512-token content blocks the way chats and agents do: a few system
    prompts, documents reused at random, unique tails; Poisson arrivals."""
    rng = random.Random(seed)
    systems = [[i] for i in range(3)]
    docs = [list(range(100 + 10 * d, 100 + 10 * d + rng.randint(1, 6))) for d in range(num_docs)]
    next_id = 10_000
    now = 0.0
    requests = []
    for idx in range(num_requests):
        now += rng.expovariate(rate_per_s) * 1000.0
        ids = [*rng.choice(systems), *rng.choice(docs)]
        tail = rng.randint(0, 2)
        ids += range(next_id, next_id + tail)
        next_id += tail
        length = len(ids) * 512 - rng.randint(0, 511)
        requests.append(TraceRequest(f"syn-{idx}", now, length, output_length, tuple(ids),
                                     tenant=rng.choice([None, "t1"])))
    return Workload("synthetic", tuple(requests))


def with_outputs(workload: Workload, output_length: int) -> Workload:
    return Workload(workload.name, tuple(dataclasses.replace(r, output_length=output_length)
                                         for r in workload.requests))


def run(workload: Workload, *, workers: int = 1, capacity: int = 100_000, block_size: int = 16,
        profile: CostProfile = ZERO, policy: str = "round_robin", **options: object) -> SimResult:
    """One simulation; `options` go to SimConfig (or WorkerConfig, for its field names)."""
    worker_fields = {f.name for f in dataclasses.fields(WorkerConfig)}
    worker_opts = {k: v for k, v in options.items() if k in worker_fields}
    sim_opts = {k: v for k, v in options.items() if k not in worker_fields}
    worker = WorkerConfig(capacity // block_size, block_size, **worker_opts)  # type: ignore[arg-type]
    config = SimConfig(workers, worker, profile, policy, **sim_opts)  # type: ignore[arg-type]
    return FleetSimulator(config, workload).run()
