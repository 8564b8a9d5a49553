"""Reporting for `kvserve bench serve`: the side-by-side table and the JSON lines.

Ratios are always first measured server / other server (for `--launch kvserve,vllm`,
kvserve/vLLM): below 1 is better for latencies, above 1 is better for throughputs. A launched
server's resident memory (its process tree's, MiB: after start and peak while measured) is a
line under the table and two fields of each JSON row; servers given by URL have none ("-",
null).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from kvserve.bench.serve_load import LevelSummary


@dataclass(slots=True)
class ServerRun:
    """One server's results, one summary per concurrency it reached, in order; `skipped` says why
    it stopped before the last (or, with no levels, why none was measured);
    `info` holds per-server figures (launched: startup_s, start_rss_mib, peak_rss_mib)."""

    label: str
    url: str | None = None
    levels: list[LevelSummary] = field(default_factory=list)
    skipped: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


# (column, getter): the metrics shown per server and compared in ratio rows.
METRICS: tuple[tuple[str, Callable[[LevelSummary], float]], ...] = (
    ("TTFT p50 ms", lambda s: s.ttft_ms["p50"]),
    ("TTFT p99 ms", lambda s: s.ttft_ms["p99"]),
    ("ITL mean ms", lambda s: s.itl_ms["mean"]),
    ("ITL p99 ms", lambda s: s.itl_ms["p99"]),
    ("TPOT mean ms", lambda s: s.tpot_ms["mean"]),
    ("req/s", lambda s: s.request_throughput),
    ("out tok/s", lambda s: s.output_throughput),
)


def ratio(a: float, b: float) -> float:
    return a / b if b and not (math.isnan(a) or math.isnan(b)) else float("nan")


def ratios(ours: LevelSummary, peer: LevelSummary) -> dict[str, float]:
    """Every metric of METRICS as ours / peer, keyed like the JSON fields."""
    keys = ("ttft_p50", "ttft_p99", "itl_mean", "itl_p99", "tpot_mean", "request_throughput",
            "output_throughput")
    return {k: ratio(get(ours), get(peer)) for k, (_, get) in zip(keys, METRICS, strict=True)}


RSS_KEYS = ("start_rss_mib", "peak_rss_mib")  # in `ServerRun.info` of launched servers


def level_at(run: ServerRun, i: int) -> LevelSummary | None:
    """The run's summary at the i-th concurrency, None where it stopped before reaching it."""
    return run.levels[i] if i < len(run.levels) else None


def json_rows(runs: list[ServerRun], concurrencies: list[int],
              workload: dict[str, Any]) -> list[dict[str, Any]]:
    """One object per server x concurrency: the level's figures, or `skipped` (why) for a level
    the server did not reach; the first server that measured any level carries its ratios
    against every other server measured at the same level."""
    base = next((r for r in runs if r.levels), None)
    rows = []
    for run in runs:
        for i, c in enumerate(concurrencies):
            row: dict[str, Any] = {"server": run.label, "url": run.url} | workload
            s = level_at(run, i)
            if s is None:
                rows.append(row | {"concurrency": c, "skipped": run.skipped or "not measured"})
                continue
            row |= s.as_dict() | dict.fromkeys(RSS_KEYS) | run.info
            peers = [(p.label, p_s) for p in runs if p is not run
                     and (p_s := level_at(p, i)) is not None]
            if run is base and peers:
                row["ratios_vs"] = {label: ratios(s, p_s) for label, p_s in peers}
            if run.skipped is not None:
                row["stopped_later"] = run.skipped
            rows.append(row)
    return rows


def _fmt(value: float, digits: int = 1) -> str:
    return "-" if math.isnan(value) else f"{value:,.{digits}f}"


def rss_text(run: ServerRun) -> str:
    """`RSS <start> MiB after start, peak <peak> MiB`; `RSS -` when not read (URL servers)."""
    start, peak = (run.info.get(k) for k in RSS_KEYS)
    if start is None or peak is None:
        return "RSS -"
    return f"RSS {start:,.0f} MiB after start, peak {peak:,.0f} MiB"


def print_table(runs: list[ServerRun], concurrencies: list[int], title: str) -> None:
    """Rows per concurrency: each server that reached it, then first/other ratios; then errors,
    why a server stopped or was skipped, and each measured server's RSS. chunks/tok: non-empty
    stream chunks per output token (1.00 = one chunk a token)."""
    table = Table(title=title)
    for col in ("conc", "server", "ok/sent", "chunks/tok", *(name for name, _ in METRICS)):
        table.add_column(col, justify="right")
    base = next((r for r in runs if r.levels), None)
    for i, c in enumerate(concurrencies):
        present = [r for r in runs if level_at(r, i) is not None]
        for run in present:
            s = run.levels[i]
            table.add_row(str(c), run.label, f"{s.completed}/{s.num_requests}",
                          _fmt(ratio(s.content_chunks, s.output_tokens), 2),
                          *(_fmt(get(s)) for _, get in METRICS))
        for peer in present:
            if base is None or peer is base or base not in present:
                continue
            r = ratios(base.levels[i], peer.levels[i])
            table.add_row(str(c), f"{base.label}/{peer.label}", "", "",
                          *(f"{_fmt(v, 2)}x" for v in r.values()), style="bold")
        table.add_section()
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
    for run in runs:
        for s in run.levels:
            for err in s.errors:
                console.print(f"{run.label} c={s.concurrency}: {err}", soft_wrap=True,
                              highlight=False)
        if run.skipped is not None:
            what = "stopped" if run.levels else "skipped"
            console.print(f"{run.label}: {what}: {run.skipped}", soft_wrap=True,
                          highlight=False)
    measured = [r for r in runs if r.levels]
    for run in measured:
        console.print(f"{run.label}: {rss_text(run)}", soft_wrap=True, highlight=False)
    sys.stdout.flush()
