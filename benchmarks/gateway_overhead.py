"""The `overhead` case of `python -m benchmarks gateway`: what a router adds to each request.

Short requests (a `--overhead-prompt-tokens` prompt, one output token, streamed) so the worker
does as little as possible and the router's own cost shows: first one at a time (latency p50 /
p99, compared with a direct connection to the workers: the added latency), then
`--overhead-concurrency` at a time (the most requests per second the path sustains). "Direct" is
the `ideal` router: the clients rotate over the workers themselves. All of it runs on this one
machine: router, workers and clients share its cores, as a sidecar gateway would.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from kvserve.bench.serve_load import completion_body, percentile, send_one


@dataclass(slots=True)
class OverheadRun:
    router: str
    latency_ms: dict[str, float]
    max_rps: float
    failed: int
    added_ms: float = float("nan")
    rps_vs_direct: float = float("nan")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


async def _measure(entries: Sequence[str], prompts: Sequence[str], model: str,
                   sequential: int, concurrent: int, concurrency: int) -> tuple[list[float],
                                                                               float, int]:
    rotation = itertools.cycle(entries)
    bodies = [completion_body(model, p, 1) for p in prompts]
    latencies: list[float] = []
    failed = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60.0, limits=limits) as client:
        for body in bodies[:8]:  # warm-up: connections, the worker's first-request costs
            await send_one(client, next(rotation), body)
        for i in range(sequential):
            record = await send_one(client, next(rotation), bodies[i % len(bodies)])
            if record.error is None:
                latencies.append((record.end - record.start) * 1e3)
            else:
                failed += 1
        todo = iter(range(concurrent))
        done = 0

        async def worker() -> None:
            nonlocal done, failed
            for i in todo:
                record = await send_one(client, next(rotation), bodies[i % len(bodies)])
                done += record.error is None
                failed += record.error is not None

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        rps = done / (time.perf_counter() - start)
    return latencies, rps, failed


def measure_overhead(label: str, entries: Sequence[str], prompts: Sequence[str], model: str,
                     sequential: int = 200, concurrent: int = 1000,
                     concurrency: int = 64) -> OverheadRun:
    latencies, rps, failed = asyncio.run(
        _measure(entries, prompts, model, sequential, concurrent, concurrency))
    return OverheadRun(label, {"p50": percentile(latencies, 50), "p99": percentile(latencies, 99)},
                       rps, failed)


def print_overhead(runs: Sequence[OverheadRun]) -> None:
    """Each path against the direct run before it (with --repeats, that repeat's own)."""
    direct: OverheadRun | None = None
    table = Table(title="router overhead: 1-token completions (direct = clients rotate over "
                  "the workers)", title_justify="left")
    for col in ("path", "latency p50 ms", "p99 ms", "added p50 ms", "max req/s",
                "vs direct", "failed"):
        table.add_column(col, justify="left" if col == "path" else "right")
    for r in runs:
        if r.router == "ideal":
            direct = r
        elif direct is not None:
            r.added_ms = r.latency_ms["p50"] - direct.latency_ms["p50"]
            r.rps_vs_direct = r.max_rps / direct.max_rps if direct.max_rps else float("nan")
        table.add_row("direct" if r is direct else r.router, f"{r.latency_ms['p50']:.2f}",
                      f"{r.latency_ms['p99']:.2f}",
                      "" if math.isnan(r.added_ms) else f"{r.added_ms:+.2f}", f"{r.max_rps:.0f}",
                      "" if math.isnan(r.rps_vs_direct) else f"{r.rps_vs_direct:.2f}",
                      str(r.failed))
    Console(width=200).print(table)
