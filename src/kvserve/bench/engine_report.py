"""Summaries of `kvserve bench engine` runs: per-system figures, ratios, the JSON and the table.

Ratios are kvserve / peer on the same model and workload in the same run: above 1 for output
tokens/s means kvserve is faster; below 1 for TTFT means kvserve answers sooner. "kvserve" is
the first kvserve mode run (`--precision`'s first); the others' parity is their greedy
agreement with it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from kvserve.bench.engine_systems import KVSERVE, RunResult
from kvserve.bench.engine_workloads import Workload
from kvserve.percentiles import percentile


def summarize(result: RunResult, reference: RunResult | None) -> dict[str, Any]:
    """JSON-ready figures of one run; `parity_vs_kvserve` is the fraction of requests whose
    tokens equal `reference`'s (kvserve's) exactly, None without a reference; `peak_rss_mib` as
    the run measured it (RunResult)."""
    if result.skipped is not None:
        return {"skipped": result.skipped}
    parity = None
    if reference is not None and reference.skipped is None and reference.output_token_ids:
        same = sum(a == b for a, b in zip(result.output_token_ids, reference.output_token_ids,
                                          strict=True))
        parity = same / len(reference.output_token_ids)
    ttft = result.ttft_s
    return {
        "output_tokens": result.num_output_tokens,
        "seconds": result.seconds,
        "output_tok_per_s": result.num_output_tokens / result.seconds if result.seconds else 0.0,
        "ttft_mean_s": sum(ttft) / len(ttft) if ttft else None,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "parity_vs_kvserve": parity,
        "peak_rss_mib": result.peak_rss_mib,
        "info": result.info,
    }


@dataclass(slots=True)
class Cell:
    """One model x workload: every system's run, kvserve's first."""

    model: str
    model_dir: str
    workload: Workload
    runs: list[RunResult]

    def as_dict(self) -> dict[str, Any]:
        """The `--json` object: sizes, per-system summaries, and kvserve/peer ratios."""
        ours = next((r for r in self.runs if r.system.startswith(KVSERVE)), None)
        systems = {r.system: summarize(r, ours) for r in self.runs}
        ratios: dict[str, dict[str, float | None]] = {}
        mine = systems.get(ours.system, {}) if ours is not None else {}
        for name, peer in systems.items():
            if name.startswith(KVSERVE) or "skipped" in peer or "skipped" in mine or not mine:
                continue
            ratios[name] = {
                "output_tok_per_s": _ratio(mine["output_tok_per_s"], peer["output_tok_per_s"]),
                "ttft_p50": _ratio(mine["ttft_p50_s"], peer["ttft_p50_s"]),
                "ttft_p99": _ratio(mine["ttft_p99_s"], peer["ttft_p99_s"]),
            }
        w = self.workload
        return {"model": self.model, "model_dir": self.model_dir, "workload": w.name,
                "num_prompts": len(w.prompts), "prompt_tokens": w.num_prompt_tokens,
                "max_tokens": w.max_tokens, "systems": systems, "ratios_kvserve_over": ratios}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f}"


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def print_table(cells: Sequence[Cell], title: str) -> None:
    """One row per system per cell; ratio columns are kvserve / that peer."""
    table = Table(title=title, caption="ratio = kvserve / peer: tok/s > 1 and TTFT < 1 favour "
                  "kvserve; parity = share of requests token-identical to kvserve's")
    for col in ("model", "workload", "system", "out tok/s", "TTFT mean ms", "TTFT p50 ms",
                "TTFT p99 ms", "parity", "peak RSS MiB", "tok/s ratio", "TTFT p50 ratio",
                "TTFT p99 ratio"):
        left = col in ("model", "workload", "system")
        # Workload and system names stay whole (e.g. "vllm:bfloat16"); a long model path wraps.
        table.add_column(col, justify="left" if left else "right",
                         no_wrap=col in ("workload", "system"))
    for cell in cells:
        data = cell.as_dict()
        for system, s in data["systems"].items():
            if "skipped" in s:
                table.add_row(cell.model, cell.workload.name, system,
                              f"skipped: {s['skipped']}"[:80], *["-"] * 8)
                continue
            r = data["ratios_kvserve_over"].get(system)
            parity = s["parity_vs_kvserve"]
            table.add_row(
                cell.model, cell.workload.name, system, f"{s['output_tok_per_s']:,.0f}",
                _ms(s["ttft_mean_s"]), _ms(s["ttft_p50_s"]), _ms(s["ttft_p99_s"]),
                "-" if parity is None or system == KVSERVE else f"{parity:.0%}",
                "-" if s["peak_rss_mib"] is None else f"{s['peak_rss_mib']:,.0f}",
                *(["-"] * 3 if r is None else [_x(r["output_tok_per_s"]), _x(r["ttft_p50"]),
                                               _x(r["ttft_p99"])]))
        table.add_section()
    # Off a terminal (pipes, CI logs) rich would wrap at 80 columns; a table reads better whole.
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    sys.stdout.flush()
    for cell in cells:
        for run in cell.runs:
            share = run.info.get("of_limits")
            if share:
                print(f"{cell.model} {cell.workload.name} {run.system}: weights read "
                      f"{share['weight_gb_s']:.2f} GB/s = {share['of_read_bandwidth']:.0%} of "
                      f"the read bandwidth; matmuls {share['gflops']:.1f} GFLOP/s = "
                      f"{share['of_gemm_rate']:.0%} of the GEMM rate")
