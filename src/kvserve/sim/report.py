"""The results of a simulation as a rich table and a JSON file."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from kvserve.sim.metrics import SimResult


def _s(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f}ms" if value < 1.0 else f"{value:.2f}s"


def _tokens(value: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.1f}{unit}"
    return str(value)


def results_table(results: Sequence[SimResult], title: str) -> Table:
    """One row per run: cache, latency, throughput, load and the retry storm's footprint;
    LoRA adapter loads per answered request when any run loaded adapters."""
    table = Table(title=title, title_justify="left")
    adapters = any(r.adapter_loads for r in results)
    for name in ("run", "hit rate", *(("loads/req",) if adapters else ()), "TTFT p50/p99",
                 "e2e p50/p99", "TTFT≤SLO", "answered",
                 "req/s", "out tok/s", "util avg/max", "preempt", "retries/429", "sent",
                 "computed", "wasted", "audit"):
        table.add_column(name, justify="left" if name == "run" else "right", no_wrap=True)
    for r in results:
        table.add_row(
            escape(r.label),
            f"{r.hit_rate:.1%}",
            *((f"{r.adapter_loads_per_request:.3f}",) if adapters else ()),
            f"{_s(r.ttft_p50)}/{_s(r.ttft_p99)}",
            f"{_s(r.e2e_p50)}/{_s(r.e2e_p99)}",
            f"{r.slo_attainment:.1%}",
            f"{r.num_ok}/{r.num_requests}",
            f"{r.requests_per_s:.2f}",
            f"{r.output_tokens_per_s:.0f}",
            f"{r.utilization_mean:.0%}/{r.utilization_max:.0%}",
            str(r.num_preemptions),
            f"{r.num_retries}/{r.num_throttled}",
            str(r.num_attempts),
            _tokens(r.computed_tokens),
            _tokens(r.wasted_tokens),
            "[green]ok[/]" if r.audit_ok else "[red]FAILED[/]",
        )
    return table


def write_json(results: Sequence[SimResult], path: Path, meta: dict[str, Any]) -> None:
    """Every run in full (per-request TTFTs, the timeline, per-worker figures), plus `meta`
    (the command line's settings)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"meta": meta, "runs": [r.as_dict() for r in results]}
    path.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
