"""PNG plots of benchmark results (`--plot DIR`), drawn from the run's own figures.

- `kvserve bench engine`: engine_tokens_per_s.png, output tokens/s of every system per model and
  workload (kvserve against vLLM and Hugging Face), skipped systems left out.
- `python -m benchmarks gateway`: gateway_hit_rate.png (per case, each router's mean hit rate
  over its seeds, the bar spanning min to max) and gateway_ttft_cdf.png (per case, each router's
  TTFT CDF pooled over its seeds, as a share of every request sent, so lost requests keep a curve
  below 100%).

matplotlib (the `plot` extra) is imported only here, on the Agg backend, so no display is needed;
without it `PlotsUnavailable` says how to install it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ENGINE_PNG = "engine_tokens_per_s.png"
GATEWAY_HIT_PNG = "gateway_hit_rate.png"
GATEWAY_CDF_PNG = "gateway_ttft_cdf.png"


class PlotsUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotsUnavailable("--plot needs matplotlib: pip install 'kvserve[plot]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def require_plots(plot_dir: Path | None) -> None:
    """Raise `PlotsUnavailable` now, before a long run, if `--plot` was given without
    matplotlib."""
    if plot_dir is not None:
        _pyplot()


def engine_plot(cells: Sequence[Mapping[str, Any]], out_dir: Path, title: str) -> Path:
    """Grouped bars of output tokens/s, one group per (model, workload) cell, one bar per
    measured system; `cells` are `Cell.as_dict()` objects. Returns the PNG's path."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    systems = list(dict.fromkeys(s for c in cells for s, fig in c["systems"].items()
                                 if "skipped" not in fig))
    groups = [f"{c['model']}\n{c['workload']}" for c in cells]
    width = 0.8 / max(len(systems), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(cells)), 4.5))
    for i, system in enumerate(systems):
        xs, ys = [], []
        for j, cell in enumerate(cells):
            fig_ = cell["systems"].get(system, {})
            if "output_tok_per_s" in fig_:
                xs.append(j - 0.4 + width * (i + 0.5))
                ys.append(fig_["output_tok_per_s"])
        bars = ax.bar(xs, ys, width, label=system)
        ax.bar_label(bars, fmt="{:,.0f}", fontsize=7, padding=2)
    ax.set_xticks(range(len(cells)), groups)
    ax.set(ylabel="output tokens / s, log scale (higher is better)", title=title)
    ax.set_yscale("log")
    top = max((f["output_tok_per_s"] for c in cells for f in c["systems"].values()
               if "output_tok_per_s" in f), default=1.0)
    ax.set_ylim(top=max(top, 1.0) * 3)  # room for the bar labels and the legend
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.yaxis.set_minor_formatter(plt.NullFormatter())
    ax.grid(axis="y", alpha=0.3, which="both")
    ax.legend(fontsize=8, ncol=max(len(systems), 1), loc="upper center")
    fig.tight_layout()
    path = out_dir / ENGINE_PNG
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _router_label(run: Any) -> str:
    return run.router + (f" x{run.replicas}" if run.replicas > 1 else "")


def gateway_plots(runs: Sequence[Any], out_dir: Path, title: str) -> list[Path]:
    """The hit-rate bars and the TTFT CDFs of `python -m benchmarks gateway` runs (`CaseRun`s: case,
    router, replicas, hit_rate, ttfts_ms, requests), one panel per case. Returns the paths."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    cases: dict[str, dict[str, list[Any]]] = {}
    for run in runs:
        cases.setdefault(run.case, {}).setdefault(_router_label(run), []).append(run)
    n = max(len(cases), 1)

    fig, axes = plt.subplots(1, n, figsize=(max(6.0, 4.2 * n), 4.5), squeeze=False)
    for ax, (case, by_router) in zip(axes[0], cases.items(), strict=False):
        labels = list(by_router)
        means = [100 * sum(r.hit_rate for r in g) / len(g) for g in by_router.values()]
        lows = [m - 100 * min(r.hit_rate for r in g) for m, g in zip(means, by_router.values(),
                                                                      strict=True)]
        highs = [100 * max(r.hit_rate for r in g) - m for m, g in zip(means, by_router.values(),
                                                                       strict=True)]
        bars = ax.bar(range(len(labels)), means, yerr=[lows, highs], capsize=3,
                      color=[f"C{i}" for i in range(len(labels))])
        ax.bar_label(bars, fmt="{:.1f}", fontsize=7, padding=2)
        ax.set_xticks(range(len(labels)), labels, rotation=25, ha="right", fontsize=7)
        ax.set(title=case, ylabel="fleet prefix-cache hit rate (%)", ylim=(0, 105))
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{title}: hit rate (mean over seeds, min to max)", fontsize=10)
    fig.tight_layout()
    hit_path = out_dir / GATEWAY_HIT_PNG
    fig.savefig(hit_path, dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, n, figsize=(max(6.0, 4.2 * n), 4.5), squeeze=False)
    for ax, (case, by_router) in zip(axes[0], cases.items(), strict=False):
        for label, group in by_router.items():
            ttfts = sorted(t for r in group for t in r.ttfts_ms)
            sent = sum(r.requests for r in group)
            if ttfts and sent:
                ys = [100 * (i + 1) / sent for i in range(len(ttfts))]
                ax.step([max(t, 1.0) for t in ttfts], ys, where="post", label=label,
                        linewidth=1.2)
        ax.set(xscale="log", title=case, xlabel="time to first token (ms)",
               ylabel="requests answered within (% of all sent)", ylim=(0, 101))
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(f"{title}: TTFT CDF, pooled over seeds", fontsize=10)
    fig.tight_layout()
    cdf_path = out_dir / GATEWAY_CDF_PNG
    fig.savefig(cdf_path, dpi=120)
    plt.close(fig)
    return [hit_path, cdf_path]
