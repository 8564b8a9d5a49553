"""Prometheus series of the tensor-parallel group's collectives, from rank 0's counters.

`kvserve:collective_duration_seconds{op,backend}` (histogram), `kvserve:collective_errors_total
{op,kind}` (every op and kind from zero, so `rate()` and `increase()` alerts see the first
error), `kvserve:collective_rank_skew_seconds` (histogram: per step, what the fastest rank waited
for the slowest), the slowest rank of the last step, and step divergences. A single-rank worker
exports none of them.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from kvserve.runtime import AsyncEngine
from kvserve.runtime.collective_stats import DURATION_BUCKETS, CollectiveErrorKind, Histogram

OPS = ("all_reduce", "all_gather", "broadcast", "heartbeat")

Metric = CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily


class CollectiveCollector(Collector):
    """Reads `engine.collective_stats` at scrape time (a locked snapshot)."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.collective_stats
        if stats is None:
            return
        snap = stats.snapshot()
        name = self.model_name
        durations = HistogramMetricFamily(
            "kvserve:collective_duration_seconds",
            "Wall time of each collective on the serving path, on rank 0.",
            labels=["model_name", "op", "backend"])
        for (op, backend), hist in sorted(snap.durations.items()):
            durations.add_metric([name, op, backend], _buckets(hist), sum_value=hist.total)
        yield durations
        errors = CounterMetricFamily("kvserve:collective_errors",
                                     "Collectives that failed, by op and kind.",
                                     labels=["model_name", "op", "kind"])
        for op in OPS:
            for kind in CollectiveErrorKind:
                errors.add_metric([name, op, kind.value], snap.errors.get((op, kind.value), 0))
        yield errors
        skew = HistogramMetricFamily(
            "kvserve:collective_rank_skew_seconds",
            "Per step: slowest minus fastest rank's compute time (what the others waited).",
            labels=["model_name"])
        skew.add_metric([name], _buckets(snap.rank_skew), sum_value=snap.rank_skew.total)
        yield skew
        slowest = GaugeMetricFamily("kvserve:collective_slowest_rank",
                                    "The rank that computed longest in the last step.",
                                    labels=["model_name"])
        slowest.add_metric([name], snap.slowest_rank)
        yield slowest
        size = GaugeMetricFamily("kvserve:tensor_parallel_size", "Ranks in the group.",
                                 labels=["model_name"])
        size.add_metric([name], snap.world_size)
        yield size
        divergences = CounterMetricFamily(
            "kvserve:tp_step_divergences",
            "Steps a rank was about to run with another step id or block tables than rank 0's.",
            labels=["model_name"])
        divergences.add_metric([name], snap.num_divergences)
        yield divergences


def _buckets(hist: Histogram) -> list[tuple[str, float]]:
    """Cumulative (le, count) pairs, +Inf last."""
    out, total = [], 0
    for bound, count in zip((*map(str, DURATION_BUCKETS), "+Inf"), hist.counts, strict=True):
        total += count
        out.append((bound, float(total)))
    return out
